#!/usr/bin/env python3
"""KDA ReplaySSM decode on one GPU: ours (``tp_replayssm.ops.replayssm_decode``) against FLA 0.6.0's
packed in-place decode (``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd``), cycle-averaged.

Method (see /work/.library/device/METHOD.md):

- First the device copy bandwidth: a large device-to-device copy, bytes read + written, median.
- Per shape, a pool-like set of tensors with ``S = n_sets * B`` slots (random, never zero) is split
  into ``n_sets`` disjoint slot sets, enough that the data touched by one graph replay exceeds the L2
  several times (default 4x L2, at most ``--max-graph-steps`` steps per graph). Every step reads its
  own input set (``mixed_qkv``, ``a``, ``b``, ``out``) where memory allows.
- Ours: ONE CUDA graph holds, for every slot set, one full cursor cycle: ``L`` consecutive steps with
  cursors ``0 .. L-1`` (the last one flushes), each step what the pool runs (``--advance pool``, the
  default since the eighth session): the op reading the pool's slot-indexed cursor table
  (``ops.decode_with_cursor_table``), then the pool's cursor-advance kernel on that table
  (``cursor_kernel.advance``: ``c -> 0`` after a flush, else ``c + 1``). Sessions 1-7 used a
  row-indexed cursor and a small Triton advance kernel of this file (``--advance triton``). us/step =
  median replay time / (n_sets * L). Also timed: the same graph with constant per-step ``write_pos`` tensors
  and no advance kernel (``op_us``: the op alone), and eager calls (no graph) over one cycle.
- FLA: the same slot sets and inputs, one in-place packed step per (set, step), graph-captured.
  Gate (``A_log``, ``dt_bias``, ``lower_bound``), beta sigmoid and q/k l2norm run inside FLA's kernel
  (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``, ``use_qk_l2norm_in_kernel``); FLA needs
  ``q, k, v`` as separate contiguous tensors, so they are split from ``mixed_qkv`` once, outside the
  timed region (that copy is NOT timed: FLA gets its best case).
- Correctness per shape, before timing: one step of ours against ``tp_replayssm.reference`` on fresh
  random inputs and copies of the pool (random cursors incl. a flush row and, for B >= 4, a padding
  row; output poisoned with NaN first): rel. error of ``out``, of the flushed checkpoints and of the
  appended ring entries; non-flushed checkpoints must be untouched and padding rows zero. FLA's ``out``
  is checked against the reference at cursor 0 (empty ring) so the baseline computes the same thing.
- Bytes: :mod:`tp_replayssm.byte_model` (cycle mean for ours, state read+write every step for FLA);
  ``%floor = (model bytes / copy bandwidth) / measured time``.

Run on the device (from the repository root)::

    pip install --no-index --no-deps --target /tmp/site .devwheels/*.whl
    PYTHONPATH=/tmp/site:. python3 benchmarks/bench_decode.py            # default sweep, < 8 min
    PYTHONPATH=/tmp/site:. python3 benchmarks/bench_decode.py --quick    # a few shapes, < 2 min
    python3 benchmarks/bench_decode.py --dry-run                         # the plan + byte floors, any machine

Results: ``$OUT/bench_decode.{json,csv}`` (else ``benchmarks/out/``) and, with matplotlib, the plots
of ``benchmarks/plot_results.py``. The compact table is printed last.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

if __name__ == "__main__" and "--allow-autotune" not in sys.argv[1:]:
    # before anything imports helion: an unpinned kernel compiles its default config instead of
    # autotuning in the middle of the sweep (the run must fit its time budget)
    os.environ.setdefault("HELION_AUTOTUNE_EFFORT", "none")

import torch  # noqa: E402

from tp_replayssm.byte_model import DecodeConfig, floor_us, packed_bytes, replay_bytes  # noqa: E402

try:  # the cursor-advance kernel; Triton is optional (torch ops fall back)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - no triton on this machine
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _advance_cursor_kernel(cursor_ptr, n, last, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        c = tl.load(cursor_ptr + offs, mask=mask, other=0)
        c = tl.where(c >= last, 0, c + 1)
        tl.store(cursor_ptr + offs, c, mask=mask)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALL_B = (1, 8, 32, 128, 512)
OURS_SPEC = "tp_replayssm.ops:replayssm_decode"
FLA_SPEC = "fla.ops.kda.fused_recurrent:fused_recurrent_kda_fwd"
FLA_NOTE = ("FLA 0.6.0 fused_recurrent_kda_fwd(inplace_final_state=True, state_v_first=True, "
            "ssm_state_indices, use_gate_in_kernel, use_beta_sigmoid_in_kernel, use_qk_l2norm_in_kernel "
            "as ours, lower_bound as ours); q/k/v pre-split into contiguous tensors outside the timed region")


def log(*args: object) -> None:
    print(*args, flush=True)


# ----------------------------------------------------------------------------------------------
# shapes


@dataclasses.dataclass(frozen=True)
class Shape:
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

    def config(self, cache: str, act: str) -> DecodeConfig:
        return DecodeConfig(self.B, self.H, self.HV, key_dim=self.K, value_dim=self.V, ring_length=self.L,
                            state_dtype=self.state, cache_dtype=cache, act_dtype=act, lower_bound=self.lb)


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


def default_plan() -> list[Shape]:
    """The issue's sweep, cut: full B sweep where it matters most, spot checks elsewhere (priority order)."""
    both = ("fp32", "bf16")
    shapes = []
    shapes += _grid([(32, 32), (8, 8)], ALL_B, (16,), both, (None,))  # 20: TP1 / TP4 of Kimi-Linear
    shapes += _grid([(16, 16), (12, 12), (4, 4)], (1, 8, 128, 512), (16,), both, (None,))  # 24
    shapes += _grid([(16, 32)], (8, 128, 512), (16,), both, (None,))  # 6: GQA HV = 2H
    shapes += _grid([(32, 32), (8, 8)], (8, 512), (16,), both, (-5.0,))  # 8: bounded gate
    shapes += _grid([(32, 32), (8, 8)], (1, 128, 512), (8,), both, (None,))  # 12: L = 8
    return _dedupe(shapes)


def quick_plan() -> list[Shape]:
    return [
        Shape(32, 32, 512, 16, "fp32", None),
        Shape(32, 32, 512, 16, "bf16", None),
        Shape(8, 8, 512, 16, "fp32", None),
        Shape(8, 8, 512, 16, "bf16", None),
        Shape(32, 32, 128, 16, "fp32", None),  # issue 5's floor target starts at B = 128
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


def build_plan(args: argparse.Namespace) -> list[Shape]:
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
        shapes = quick_plan()
    else:
        shapes = default_plan()
    for s in shapes:
        if s.state not in DTYPES:
            raise SystemExit(f"bench_decode: unknown state dtype {s.state!r}; use fp32 or bf16")
        if s.HV % s.H:
            raise SystemExit(f"bench_decode: HV % H must be 0; got H={s.H}, HV={s.HV}")
    shapes = shapes[args.start_at:]
    if args.max_shapes:
        shapes = shapes[: args.max_shapes]
    return _dedupe(shapes)


# ----------------------------------------------------------------------------------------------
# arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="KDA ReplaySSM decode benchmark (ours vs FLA packed decode), cycle-averaged, graph-captured.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("shapes (any of these switches to a cross-product grid)")
    g.add_argument("--quick", action="store_true", help="a few shapes, < 2 minutes")
    g.add_argument("--heads", help="comma list of HV (H = HV) or HxHV for GQA, e.g. '32,8,16x32' [grid default 32,8]")
    g.add_argument("--batch", help="comma list of B [grid default 1,8,32,128,512]")
    g.add_argument("--state", help="comma list of state dtypes fp32,bf16 [grid default both]")
    g.add_argument("--ring", help="comma list of ring lengths L [grid default 16]")
    g.add_argument("--lower-bound", help="comma list: none and/or numbers, e.g. 'none,-5' [grid default none]")
    g.add_argument("--key-dim", type=int, default=128)
    g.add_argument("--value-dim", type=int, default=128)
    g.add_argument("--start-at", type=int, default=0, help="skip the first N shapes of the plan (resume a cut sweep)")
    g.add_argument("--max-shapes", type=int, default=0, help="then keep only the first N shapes (0 = all)")
    g.add_argument("--cache-dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="ring dtype")
    g.add_argument("--act-dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="activation dtype")

    m = p.add_argument_group("method")
    m.add_argument("--only", choices=["both", "ours", "fla"], default="both", help="which implementations to run")
    m.add_argument("--ours", default=OURS_SPEC, help="module:function of our op (signature of SPEC section 1)")
    m.add_argument("--baseline", action="append", default=[], metavar="NAME=module:function",
                   help="extra replay op with the same signature (e.g. a port of SGLang's kernel), timed like ours")
    m.add_argument("--advance", choices=["pool", "triton", "torch", "none"], default="pool",
                   help="cursor advance after each step inside the graph. pool: ours reads the pool's slot-indexed "
                        "cursor table (ops.decode_with_cursor_table) and advances it with the pool's kernel "
                        "(cursor_kernel.advance), as ReplaySSMStatePool.decode/advance do (other ops: triton); "
                        "triton: a row-indexed cursor and a small Triton kernel (sessions 1-7); "
                        "none: constant write_pos per step")
    m.add_argument("--phase", choices=["sync", "stagger"], default="sync",
                   help="sync: all rows at the same cursor (the issue's cycle); stagger: row b starts at b %% L")
    m.add_argument("--no-l2norm", action="store_true", help="use_qk_l2norm_in_kernel=False (default True)")
    m.add_argument("--rep-ms", type=float, default=150.0, help="time spent replaying each graph")
    m.add_argument("--min-reps", type=int, default=10)
    m.add_argument("--max-reps", type=int, default=400)
    m.add_argument("--footprint-mb", type=float, default=0.0,
                   help="bytes touched per graph replay to aim for (0 = 4x the L2 size)")
    m.add_argument("--max-graph-steps", type=int, default=4096, help="cap on steps (op calls) in one graph")
    m.add_argument("--max-input-mb", type=float, default=2048.0, help="cap on memory for rotated input sets")
    m.add_argument("--copy-mb", type=int, default=2048, help="size of the bandwidth copy (source)")
    m.add_argument("--no-eager", action="store_true", help="skip the eager (no graph) timings")
    m.add_argument("--no-check", action="store_true", help="skip the correctness spot checks")
    m.add_argument("--no-repeat", action="store_true", help="skip the second timing of ours (noise estimate)")
    m.add_argument("--tol", type=float, default=1e-2, help="max rel. error for check=ok")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--budget-s", type=float, default=0.0,
                   help="stop starting new shapes after this many seconds (0 = 400 default sweep, 80 quick)")
    m.add_argument("--allow-autotune", action="store_true",
                   help="leave HELION_AUTOTUNE_EFFORT alone (default: set it to 'none' unless already set, "
                        "so an unpinned kernel compiles its default config instead of autotuning mid-sweep)")

    o = p.add_argument_group("output")
    o.add_argument("--out", help="output folder (default $OUT, else benchmarks/out)")
    o.add_argument("--tag", default="bench_decode", help="file name stem of the outputs")
    o.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    o.add_argument("--dry-run", action="store_true", help="print the plan and model byte floors; no GPU needed")
    o.add_argument("--assume-bw", type=float, default=4300.0, help="copy bandwidth (GB/s) for --dry-run floors")
    o.add_argument("-v", "--verbose", action="store_true", help="print full tracebacks")
    args = p.parse_args(argv)
    if not args.budget_s:
        args.budget_s = 80.0 if args.quick else 400.0
    return args


def out_dir(args: argparse.Namespace) -> Path:
    if args.out:
        d = Path(args.out)
    elif os.environ.get("OUT"):
        d = Path(os.environ["OUT"])
    else:
        d = REPO / "benchmarks" / "out"
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_callable(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"expected module:function, got {spec!r}")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------------------------
# timing primitives


def measure_copy_bandwidth(device: torch.device, mb: int, reps: int = 30) -> dict[str, float]:
    """Device-to-device copy of ``mb`` MiB of random bytes; GB/s counts bytes read + written."""
    n = mb * 2**20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in evs:
        s.record()
        dst.copy_(src)
        e.record()
    torch.cuda.synchronize(device)
    ms = sorted(s.elapsed_time(e) for s, e in evs)
    if not torch.equal(dst[: 1 << 20], src[: 1 << 20]):
        raise RuntimeError("copy bandwidth: the copy is wrong")
    del src, dst
    med = statistics.median(ms)
    return {"copy_bytes": 2.0 * n, "copy_ms_median": med, "copy_gbps": 2.0 * n / (med * 1e-3) / 1e9,
            "copy_gbps_best": 2.0 * n / (ms[0] * 1e-3) / 1e9}


def make_advance(mode: str, L: int) -> Callable[[torch.Tensor], None] | None:
    """In-place cursor advance of a row-indexed int32 cursor tensor: ``c -> 0 if c >= L-1 else c+1``."""
    if mode == "none":
        return None
    if mode == "triton" and triton is not None:
        def advance(cursor: torch.Tensor) -> None:
            n = cursor.numel()
            _advance_cursor_kernel[(triton.cdiv(n, 1024),)](cursor, n, L - 1, BLOCK=1024)
        return advance

    def advance_torch(cursor: torch.Tensor) -> None:
        cursor.add_(1)
        cursor.remainder_(L)
    return advance_torch


def _stats_us(ms: list[float], steps: int) -> dict[str, float]:
    ms = sorted(ms)
    q = lambda f: ms[min(len(ms) - 1, int(f * (len(ms) - 1) + 0.5))]  # noqa: E731
    return {"us": statistics.median(ms) * 1e3 / steps, "p10_us": q(0.1) * 1e3 / steps,
            "p90_us": q(0.9) * 1e3 / steps, "reps": len(ms)}


class GraphRun:
    """Warm up ``fn`` on a side stream, capture it once in a CUDA graph, time replays with events."""

    def __init__(self, fn: Callable[[], None], steps: int):
        self.steps = steps
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(self.graph):
            fn()
        self.capture_s = time.perf_counter() - t0
        self.graph.replay()
        torch.cuda.synchronize()

    def measure(self, rep_ms: float, min_reps: int, max_reps: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.graph.replay()
        torch.cuda.synchronize()
        est_s = max(time.perf_counter() - t0, 1e-6)
        reps = int(min(max(rep_ms * 1e-3 / est_s, min_reps), max_reps))
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for s, e in evs:
            s.record()
            self.graph.replay()
            e.record()
        torch.cuda.synchronize()
        out = _stats_us([s.elapsed_time(e) for s, e in evs], self.steps)
        out["capture_s"] = self.capture_s
        return out


def time_eager(cycle: list[tuple[Callable[[], None], Callable[[], None] | None]], rep_ms: float,
               blocks: int = 5) -> dict[str, float]:
    """Eager calls (no graph) over one cursor cycle, repeated. ``us``: wall per step (events around
    loops of cycles, median of ``blocks`` loops); ``host_us``: CPU time spent inside the op call."""
    host = [0.0, 0]

    def run_cycle() -> None:
        for op, adv in cycle:
            t0 = time.perf_counter()
            op()
            host[0] += time.perf_counter() - t0
            host[1] += 1
            if adv is not None:
                adv()

    run_cycle()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_cycle()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    per_block = max(1, int(rep_ms * 1e-3 / est / blocks))
    host[:] = [0.0, 0]
    ms = []
    for _ in range(blocks):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(per_block):
            run_cycle()
        e.record()
        torch.cuda.synchronize()
        ms.append(s.elapsed_time(e) / per_block)
    out = _stats_us(ms, len(cycle))
    out["host_us"] = host[0] / max(host[1], 1) * 1e6
    return out


# ----------------------------------------------------------------------------------------------
# buffers


class Buffers:
    """A pool-like set of random tensors for one shape, split into ``n_sets`` disjoint slot sets."""

    def __init__(self, shape: Shape, args: argparse.Namespace, device: torch.device, l2_bytes: int,
                 need_fla: bool):
        H, HV, K, V, L, B = shape.H, shape.HV, shape.K, shape.V, shape.L, shape.B
        self.shape = shape
        sdt, cdt, adt = DTYPES[shape.state], DTYPES[args.cache_dtype], DTYPES[args.act_dtype]
        self.sdt, self.cdt, self.adt = sdt, cdt, adt
        sb, cb, ab = sdt.itemsize, cdt.itemsize, adt.itemsize
        gen = torch.Generator(device=device)
        gen.manual_seed(args.seed * 1000003 + zlib.crc32(shape.label.encode()))
        self.gen = gen

        per_set = B * (HV * V * K * sb + HV * L * V * cb + H * L * K * cb + HV * L * K * 4)
        target = args.footprint_mb * 2**20 if args.footprint_mb > 0 else 4 * l2_bytes
        max_sets = max(1, args.max_graph_steps // L)
        self.n_sets = int(max(1, min(math.ceil(target / per_set), max_sets)))
        self.S = self.n_sets * B
        self.n_steps = self.n_sets * L
        width = 2 * H * K + HV * V
        per_input = B * (width * ab + HV * K * ab + HV * ab + HV * V * ab)  # mixed, a, b, out
        if need_fla:
            per_input += B * (width * ab + HV * V * ab)  # q/k/v copies, FLA's out
        self.n_in = int(max(1, min(self.n_steps, args.max_input_mb * 2**20 // per_input)))
        self.footprint = per_set * self.n_sets + per_input * self.n_in

        S = self.S
        perm = torch.randperm(S, device=device, generator=gen).to(torch.int32)
        self.slots = [perm[i * B:(i + 1) * B].contiguous() for i in range(self.n_sets)]
        self.state = torch.randn(S, HV, V, K, device=device, dtype=sdt, generator=gen).mul_(0.05)
        self.d = torch.randn(S, HV, L, V, device=device, dtype=cdt, generator=gen).mul_(0.5)
        k = torch.randn(S, H, L, K, device=device, dtype=torch.float32, generator=gen)
        self.k = (k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)).to(cdt)
        del k
        self.g = torch.rand(S, HV, L, K, device=device, dtype=torch.float32, generator=gen).mul_(-0.2).sub_(0.01)
        self.A_log = torch.empty(HV, device=device).uniform_(-1.0, 0.5, generator=gen)
        self.dt_bias = torch.empty(HV * K, device=device).uniform_(-4.0, 0.0, generator=gen)

        base = (torch.arange(B, device=device, dtype=torch.int32) % L) if args.phase == "stagger" \
            else torch.zeros(B, device=device, dtype=torch.int32)
        self.base = base
        self.cursors = [base.clone() for _ in range(self.n_sets)]  # row-indexed cursor per slot set
        self.wp_const = [((base + t) % L).to(torch.int32).contiguous() for t in range(L)]
        # the pool's cursor table [S + 1] (entry S: padding rows' scratch), for --advance pool
        self.cursor_table = torch.zeros(S + 1, device=device, dtype=torch.int32)
        for slots in self.slots:
            self.cursor_table[slots.long()] = base

        self.mixed, self.a, self.b, self.out = [], [], [], []
        self.q4, self.k4, self.v4, self.out_fla = [], [], [], []
        for _ in range(self.n_in):
            mixed = torch.randn(B, width, device=device, dtype=adt, generator=gen)
            self.mixed.append(mixed)
            self.a.append(torch.randn(B, HV * K, device=device, dtype=adt, generator=gen))
            self.b.append(torch.randn(B, HV, device=device, dtype=adt, generator=gen))
            self.out.append(torch.zeros(B, 1, HV, V, device=device, dtype=adt))
            if need_fla:
                q4, k4, v4 = split_qkv(mixed, H, HV, K, V)
                self.q4.append(q4)
                self.k4.append(k4)
                self.v4.append(v4)
                self.out_fla.append(torch.zeros(B, 1, HV, V, device=device, dtype=adt))

    def input_index(self, set_idx: int, t: int) -> int:
        return (set_idx * self.shape.L + t) % self.n_in


def split_qkv(mixed: torch.Tensor, H: int, HV: int, K: int, V: int):
    """``mixed_qkv [B, 2HK+HV*V]`` -> contiguous ``q, k [B, 1, H, K]``, ``v [B, 1, HV, V]`` (FLA's layout)."""
    B = mixed.shape[0]
    q = mixed[:, : H * K].contiguous().view(B, 1, H, K)
    k = mixed[:, H * K: 2 * H * K].contiguous().view(B, 1, H, K)
    v = mixed[:, 2 * H * K:].contiguous().view(B, 1, HV, V)
    return q, k, v


# ----------------------------------------------------------------------------------------------
# step closures


StepList = list[tuple[Callable[[], None], Callable[[], None] | None]]


def replay_steps(op: Callable[..., Any], buf: Buffers, shape: Shape, *, l2norm: bool,
                 advance: Callable[[torch.Tensor], None] | None, sets: Sequence[int] | None = None,
                 pool: bool = False) -> StepList:
    """One full cursor cycle per slot set. With ``advance`` the cursors advance in place after every
    step; without it each step reads a constant ``write_pos`` tensor holding the same phase. With
    ``pool`` (``op`` is ours) the step is the pool's: :func:`tp_replayssm.ops.decode_with_cursor_table`
    on ``buf.cursor_table``, then :func:`tp_replayssm.cursor_kernel.advance` of that table."""
    steps: StepList = []
    if pool:
        from tp_replayssm import cursor_kernel, ops
    for si in (range(buf.n_sets) if sets is None else sets):
        for t in range(shape.L):
            j = buf.input_index(si, t)
            if pool and advance is not None:
                def step(j=j, si=si) -> None:
                    ops.decode_with_cursor_table(
                        buf.mixed[j], buf.a[j], buf.b[j], buf.A_log, buf.dt_bias, None, buf.state, buf.d, buf.k,
                        buf.g, buf.out[j], buf.slots[si], buf.cursor_table, None, use_qk_l2norm_in_kernel=l2norm,
                        lower_bound=shape.lb)

                def adv(si=si) -> None:
                    cursor_kernel.advance(buf.cursor_table, buf.slots[si], None, shape.L)
                steps.append((step, adv))
                continue

            wp = buf.cursors[si] if advance is not None else buf.wp_const[t]

            def step(j=j, si=si, wp=wp) -> None:
                op(buf.mixed[j], buf.a[j], buf.b[j], buf.A_log, buf.dt_bias, None, buf.state, buf.d, buf.k,
                   buf.g, buf.out[j], buf.slots[si], wp, None, use_qk_l2norm_in_kernel=l2norm,
                   lower_bound=shape.lb)

            adv = None
            if advance is not None:
                def adv(c=buf.cursors[si]) -> None:
                    advance(c)
            steps.append((step, adv))
    return steps


def fla_steps(fla: Callable[..., Any], buf: Buffers, shape: Shape, *, l2norm: bool,
              sets: Sequence[int] | None = None) -> StepList:
    B, HV, K = shape.B, shape.HV, shape.K
    steps: StepList = []
    for si in (range(buf.n_sets) if sets is None else sets):
        for t in range(shape.L):
            j = buf.input_index(si, t)

            def step(j=j, si=si) -> None:
                fla(q=buf.q4[j], k=buf.k4[j], v=buf.v4[j], g=buf.a[j].view(B, 1, HV, K),
                    beta=buf.b[j].view(B, 1, HV), A_log=buf.A_log, dt_bias=buf.dt_bias,
                    initial_state=buf.state, scale=None, output_final_state=False, inplace_final_state=True,
                    state_v_first=True, ssm_state_indices=buf.slots[si], use_qk_l2norm_in_kernel=l2norm,
                    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=shape.lb,
                    out=buf.out_fla[j])
            steps.append((step, None))
    return steps


def run_steps(steps: StepList) -> Callable[[], None]:
    def fn() -> None:
        for op, adv in steps:
            op()
            if adv is not None:
                adv()
    return fn


# ----------------------------------------------------------------------------------------------
# correctness


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    if a.numel() == 0:
        return 0.0
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def _fresh_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    B, H, HV, K, V = shape.B, shape.H, shape.HV, shape.K, shape.V
    mixed = torch.randn(B, 2 * H * K + HV * V, device=device, dtype=dtype, generator=gen)
    a = torch.randn(B, HV * K, device=device, dtype=dtype, generator=gen)
    b = torch.randn(B, HV, device=device, dtype=dtype, generator=gen)
    return mixed, a, b


def check_replay(op: Callable[..., Any], ref: Callable[..., Any], buf: Buffers, shape: Shape,
                 l2norm: bool) -> dict[str, Any]:
    """One step of ``op`` against the reference on copies of the pool; see the module docstring."""
    B, L, dev = shape.B, shape.L, buf.state.device
    gen = buf.gen
    slots = buf.slots[0].clone()
    if B >= 4:
        slots[0] = -1  # a padding row
    passes = []
    wp = torch.randint(0, L, (B,), device=dev, dtype=torch.int32, generator=gen)
    wp[-1] = L - 1  # at least one flush row
    passes.append(wp)
    if L > 1 and (B < 3 or bool((wp[slots >= 0] == L - 1).all())):
        passes.append(torch.randint(0, L - 1, (B,), device=dev, dtype=torch.int32, generator=gen))  # appends
    res = {"err_out": 0.0, "err_state": 0.0, "err_ring": 0.0, "pad_ok": True, "untouched_ok": True}
    for wp in passes:
        mixed, a, b = _fresh_inputs(shape, buf.adt, dev, gen)
        mine = [t.clone() for t in (buf.state, buf.d, buf.k, buf.g)]
        theirs = [t.clone() for t in (buf.state, buf.d, buf.k, buf.g)]
        out_m = torch.full((B, 1, shape.HV, shape.V), float("nan"), device=dev, dtype=buf.adt)
        out_r = torch.full_like(out_m, float("nan"))
        op(mixed, a, b, buf.A_log, buf.dt_bias, None, *mine, out_m, slots, wp, None,
           use_qk_l2norm_in_kernel=l2norm, lower_bound=shape.lb)
        ref(mixed, a, b, buf.A_log, buf.dt_bias, None, *theirs, out_r, slots, wp, None,
            use_qk_l2norm_in_kernel=l2norm, lower_bound=shape.lb)
        torch.cuda.synchronize()
        valid = slots >= 0
        res["err_out"] = max(res["err_out"], _rel_err(out_m[valid], out_r[valid]))
        if (~valid).any():
            pad = out_m[~valid]
            res["pad_ok"] = res["pad_ok"] and bool(torch.isfinite(pad).all() and (pad == 0).all())
        flush = valid & (wp == L - 1)
        keep = valid & (wp != L - 1)
        s_f = slots[flush].long()
        s_n, c_n = slots[keep].long(), wp[keep].long()
        if s_f.numel():
            res["err_state"] = max(res["err_state"], _rel_err(mine[0][s_f], theirs[0][s_f]))
        if s_n.numel():
            e_ring = max(_rel_err(mine[1][s_n, :, c_n], theirs[1][s_n, :, c_n]),
                         _rel_err(mine[2][s_n, :, c_n], theirs[2][s_n, :, c_n]),
                         _rel_err(mine[3][s_n, :, c_n], theirs[3][s_n, :, c_n]))
            res["err_ring"] = max(res["err_ring"], e_ring)
            res["untouched_ok"] = res["untouched_ok"] and bool(torch.equal(mine[0][s_n], buf.state[s_n]))
        del mine, theirs
    return res


def check_fla(fla: Callable[..., Any], ref: Callable[..., Any], buf: Buffers, shape: Shape,
              l2norm: bool) -> float:
    """FLA's ``out`` after one step vs the reference at cursor 0 (empty ring): same function?"""
    B, H, HV, K, V, dev = shape.B, shape.H, shape.HV, shape.K, shape.V, buf.state.device
    mixed, a, b = _fresh_inputs(shape, buf.adt, dev, buf.gen)
    q4, k4, v4 = split_qkv(mixed, H, HV, K, V)
    slots = buf.slots[0]
    st = buf.state.clone()
    out_f = torch.full((B, 1, HV, V), float("nan"), device=dev, dtype=buf.adt)
    fla(q=q4, k=k4, v=v4, g=a.view(B, 1, HV, K), beta=b.view(B, 1, HV), A_log=buf.A_log, dt_bias=buf.dt_bias,
        initial_state=st, scale=None, output_final_state=False, inplace_final_state=True, state_v_first=True,
        ssm_state_indices=slots, use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=shape.lb, out=out_f)
    del st
    theirs = [t.clone() for t in (buf.state, buf.d, buf.k, buf.g)]
    out_r = torch.full_like(out_f, float("nan"))
    ref(mixed, a, b, buf.A_log, buf.dt_bias, None, *theirs, out_r, slots,
        torch.zeros(B, device=dev, dtype=torch.int32), None, use_qk_l2norm_in_kernel=l2norm, lower_bound=shape.lb)
    torch.cuda.synchronize()
    err = _rel_err(out_f, out_r)
    del theirs
    return err


# ----------------------------------------------------------------------------------------------
# one shape


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:300]


def _is_fatal_cuda(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("illegal memory access", "unspecified launch failure", "device-side assert",
                                   "misaligned address", "illegal instruction", "cuda error: an illegal"))


def record_failure(rec: dict[str, Any], exc: BaseException, label: str, what: str = "",
                   verbose: bool = False) -> bool:
    """Record a failed measurement in ``rec`` (``<what>_error``/``<what>_trace``, or ``error``/``trace``)
    and log it; return whether the CUDA context is broken (the caller then stops the sweep)."""
    prefix = f"{what}_" if what else ""
    rec[f"{prefix}error"] = _short_error(exc)
    rec[f"{prefix}trace"] = traceback.format_exc(limit=8)
    log(f"  [{label}] {what + ' ' if what else ''}failed: {_short_error(exc)}")
    if verbose:
        log(traceback.format_exc())
    return _is_fatal_cuda(exc)


def release_cuda(ctx: dict[str, Any]) -> None:
    """Free the cached CUDA memory after a shape; a broken context marks the sweep fatal instead."""
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as exc:  # a broken context
        ctx["fatal"] = ctx.get("fatal") or _short_error(exc)


def run_shape(shape: Shape, ctx: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    t_shape = time.perf_counter()
    dev = ctx["device"]
    bw = ctx["copy"]["copy_gbps"]
    cfg = shape.config(args.cache_dtype, args.act_dtype)
    rb, pb = replay_bytes(cfg).total, packed_bytes(cfg).total
    rec: dict[str, Any] = {
        "H": shape.H, "HV": shape.HV, "K": shape.K, "V": shape.V, "B": shape.B, "L": shape.L,
        "state": shape.state, "cache": args.cache_dtype, "act": args.act_dtype,
        "lower_bound": shape.lb, "label": shape.label,
        "bytes_replay": rb, "bytes_packed": pb,
        "floor_replay_us": floor_us(rb, bw), "floor_packed_us": floor_us(pb, bw),
    }
    l2norm = not args.no_l2norm
    rep = (args.rep_ms, args.min_reps, args.max_reps)
    ours, fla, ref = ctx["ours"], ctx["fla"], ctx["ref"]
    buf = None
    graphs: list[GraphRun] = []
    try:
        buf = Buffers(shape, args, dev, ctx["l2_bytes"], need_fla=fla is not None)
        rec.update(n_sets=buf.n_sets, S=buf.S, graph_steps=buf.n_steps, n_inputs=buf.n_in,
                   footprint_mb=buf.footprint / 2**20)
        advance = make_advance("triton" if args.advance == "pool" else args.advance, shape.L)
        replay_impls = [("ours", ours)] + [(name, fn) for name, fn in ctx["baselines"]]
        ours_graph = None
        for name, fn in replay_impls:
            if fn is None:
                continue
            try:
                if not args.no_check:
                    chk = check_replay(fn, ref, buf, shape, l2norm)
                    for k, v in chk.items():
                        rec[f"{name}_{k}"] = v
                    worst = max(chk["err_out"], chk["err_state"], chk["err_ring"])
                    ok = worst <= args.tol and chk["pad_ok"] and chk["untouched_ok"]
                    rec[f"{name}_check"] = "ok" if ok else "WRONG"
                pool = args.advance == "pool" and name == "ours" and args.ours == OURS_SPEC
                gr = GraphRun(run_steps(replay_steps(fn, buf, shape, l2norm=l2norm, advance=advance, pool=pool)),
                              buf.n_steps)
                graphs.append(gr)
                t = gr.measure(*rep)
                rec.update({f"{name}_{k}": v for k, v in t.items()})
                if name == "ours":
                    ours_graph = gr
                if advance is not None:
                    gr0 = GraphRun(run_steps(replay_steps(fn, buf, shape, l2norm=l2norm, advance=None)),
                                   buf.n_steps)
                    graphs.append(gr0)
                    rec[f"{name}_op_us"] = gr0.measure(*rep)["us"]
                else:
                    rec[f"{name}_op_us"] = t["us"]
                if not args.no_eager:
                    e = time_eager(replay_steps(fn, buf, shape, l2norm=l2norm, advance=advance, sets=[0],
                                                pool=pool), args.rep_ms)
                    rec[f"{name}_eager_us"] = e["us"]
                    rec[f"{name}_host_us"] = e["host_us"]
                rec[f"{name}_gbps"] = rb / (rec[f"{name}_us"] * 1e-6) / 1e9
                rec[f"{name}_pct_floor"] = 100.0 * rec["floor_replay_us"] / rec[f"{name}_us"]
            except Exception as exc:  # record and go on with the other implementation
                if record_failure(rec, exc, shape.label, name, args.verbose):
                    raise
        if fla is not None:
            try:
                if not args.no_check:
                    rec["fla_err_out"] = check_fla(fla, ref, buf, shape, l2norm)
                    rec["fla_check"] = "ok" if rec["fla_err_out"] <= args.tol else "WRONG"
                gr = GraphRun(run_steps(fla_steps(fla, buf, shape, l2norm=l2norm)), buf.n_steps)
                graphs.append(gr)
                rec.update({f"fla_{k}": v for k, v in gr.measure(*rep).items()})
                if not args.no_eager:
                    e = time_eager(fla_steps(fla, buf, shape, l2norm=l2norm, sets=[0]), args.rep_ms)
                    rec["fla_eager_us"] = e["us"]
                    rec["fla_host_us"] = e["host_us"]
                rec["fla_gbps"] = pb / (rec["fla_us"] * 1e-6) / 1e9
                rec["fla_pct_floor"] = 100.0 * rec["floor_packed_us"] / rec["fla_us"]
            except Exception as exc:
                if record_failure(rec, exc, shape.label, "fla", args.verbose):
                    raise
        if ours_graph is not None and not args.no_repeat:
            rec["ours_us_repeat"] = ours_graph.measure(*rep)["us"]
            rec["ours_spread_pct"] = 100.0 * abs(rec["ours_us_repeat"] - rec["ours_us"]) / rec["ours_us"]
        if "ours_us" in rec and "fla_us" in rec:
            rec["speedup_vs_fla"] = rec["fla_us"] / rec["ours_us"]
            rec["op_speedup_vs_fla"] = rec["fla_us"] / rec["ours_op_us"]
        for name, _ in ctx["baselines"]:
            if "ours_us" in rec and f"{name}_us" in rec:
                rec[f"speedup_vs_{name}"] = rec[f"{name}_us"] / rec["ours_us"]
    except Exception as exc:
        if record_failure(rec, exc, shape.label, verbose=args.verbose):
            ctx["fatal"] = rec["error"]
    finally:
        del graphs
        del buf
        release_cuda(ctx)
    rec["shape_s"] = time.perf_counter() - t_shape
    return rec


# ----------------------------------------------------------------------------------------------
# reporting


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
    ("ours_us", "ours_us", ".1f", 8), ("op_us", "ours_op_us", ".1f", 7), ("fla_us", "fla_us", ".1f", 7),
    ("xFLA", "speedup_vs_fla", ".2f", 5), ("GB/s", "ours_gbps", ".0f", 5), ("%flr", "ours_pct_floor", ".0f", 4),
    ("fla%f", "fla_pct_floor", ".0f", 5), ("floor", "floor_replay_us", ".1f", 6),
    ("eager", "ours_eager_us", ".1f", 6), ("host", "ours_host_us", ".1f", 5),
    ("rep%", "ours_spread_pct", ".1f", 4), ("err", "ours_err_out", ".0e", 6), ("chk", None, "", 5),
]


def table_lines(results: list[dict[str, Any]], baselines: Sequence[str]) -> list[str]:
    cols = list(TABLE_COLUMNS)
    for name in baselines:
        cols.insert(8, (f"{name[:6]}", f"{name}_us", ".1f", 7))
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


def gather_meta(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from importlib import metadata

    def ver(name: str) -> str | None:
        try:
            return metadata.version(name)
        except Exception:
            return None

    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name if sys.argv else "bench_decode.py", *argv]),
        "python": platform.python_version(), "host": platform.node(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": ver("triton"), "helion": ver("helion"), "fla_core": ver("fla-core") or ver("fla_core"),
        "args": {k: v for k, v in vars(args).items()},
        "fla_note": FLA_NOTE,
        "advance_note": {"pool": "ours: ops.decode_with_cursor_table on the pool's slot-indexed cursor table, then "
                                 "the pool's cursor-advance kernel (tp_replayssm.cursor_kernel.advance), in the graph; "
                                 "other replay ops: the triton advance",
                         "triton": "one Triton kernel per step (c -> 0 if c >= L-1 else c+1), in the graph",
                         "torch": "add_ + remainder_ per step, in the graph",
                         "none": "no advance; constant write_pos tensors per step"}[args.advance],
    }
    try:
        meta["git"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                     timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        meta["git_dirty"] = bool(dirty)
    except Exception:
        meta["git"] = None
    return meta


COLUMN_HELP = """\
columns: heads = HV (or HxHV for GQA); ours_us = our op + cursor advance, us/step, graph-captured, median over
replays of full L-step cursor cycles; op_us = the same without the advance kernel; fla_us = FLA packed in-place
decode us/step (graph); xFLA = fla_us/ours_us; GB/s = replay model bytes / ours_us; %flr = replay byte floor
(model bytes / measured copy bandwidth) / ours_us; fla%f = FLA's packed byte floor / fla_us; floor = replay
floor us; eager = ours us/step without a graph (op + advance); host = CPU us inside one op call; rep% = change of ours_us
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    plan = build_plan(args)
    if args.dry_run:
        dry_run(plan, args)
        return 0
    if not torch.cuda.is_available():
        log("bench_decode: no CUDA device is visible (torch.cuda.is_available() is False); this benchmark "
            "runs on the GPU machine only. Use --dry-run to print the plan and the model's byte floors here.")
        return 2
    if not args.allow_autotune:
        os.environ.setdefault("HELION_AUTOTUNE_EFFORT", "none")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t_start = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    meta = gather_meta(args, argv)
    meta.update(gpu=props.name, sm_count=props.multi_processor_count, l2_bytes=l2_bytes,
                gpu_mem_gib=props.total_memory / 2**30,
                helion_autotune_effort=os.environ.get("HELION_AUTOTUNE_EFFORT"))
    log(f"bench_decode: {props.name}, {props.multi_processor_count} SMs, L2 {l2_bytes / 2**20:.0f} MiB; "
        f"torch {torch.__version__}, triton {meta['triton']}, helion {meta['helion']}, fla {meta['fla_core']}")
    log(f"plan: {len(plan)} shapes, budget {args.budget_s:.0f} s, advance={args.advance}, phase={args.phase}, "
        f"l2norm={not args.no_l2norm}")

    ctx: dict[str, Any] = {"device": device, "l2_bytes": l2_bytes, "ours": None, "fla": None, "ref": None,
                           "baselines": []}
    from tp_replayssm.reference import replayssm_decode as reference

    ctx["ref"] = reference
    if args.only in ("both", "ours"):
        try:
            ctx["ours"] = load_callable(args.ours)
        except Exception as exc:
            meta["ours_import_error"] = _short_error(exc)
            log(f"ours: cannot import {args.ours}: {_short_error(exc)}")
        for spec in args.baseline:
            name, _, target = spec.partition("=")
            try:
                ctx["baselines"].append((name.strip(), load_callable(target.strip())))
            except Exception as exc:
                meta[f"{name}_import_error"] = _short_error(exc)
                log(f"baseline {name}: cannot import {target}: {_short_error(exc)}")
    if args.only in ("both", "fla"):
        try:
            ctx["fla"] = load_callable(FLA_SPEC)
        except Exception as exc:
            meta["fla_import_error"] = _short_error(exc)
            log(f"fla: cannot import {FLA_SPEC}: {_short_error(exc)} (install fla-core 0.6.0 from .devwheels)")

    try:
        ctx["copy"] = measure_copy_bandwidth(device, args.copy_mb)
    except Exception as exc:
        log(f"copy bandwidth failed ({_short_error(exc)}); using --assume-bw {args.assume_bw}")
        ctx["copy"] = {"copy_gbps": args.assume_bw, "copy_error": _short_error(exc)}
    meta["copy"] = ctx["copy"]
    log(f"device copy bandwidth (read + write): {ctx['copy']['copy_gbps']:.0f} GB/s median "
        f"({ctx['copy'].get('copy_gbps_best', float('nan')):.0f} best) over {args.copy_mb} MiB")

    results: list[dict[str, Any]] = []
    durations: dict[int, float] = {}
    for i, shape in enumerate(plan):
        elapsed = time.perf_counter() - t_start
        est = durations.get(shape.B, max(durations.values(), default=5.0))
        if ctx.get("fatal"):
            results.append({**_skeleton(shape, args), "skipped": f"CUDA context broken earlier: {ctx['fatal'][:80]}"})
            continue
        if elapsed + est > args.budget_s:
            results.append({**_skeleton(shape, args), "skipped": f"time budget ({args.budget_s:.0f} s)"})
            continue
        rec = run_shape(shape, ctx, args)
        durations[shape.B] = max(durations.get(shape.B, 0.0), rec["shape_s"])
        results.append(rec)
        log(f"[{i + 1}/{len(plan)}] {shape.label:30s} ours {rec.get('ours_us', float('nan')):8.1f} us "
            f"(op {rec.get('ours_op_us', float('nan')):.1f}) fla {rec.get('fla_us', float('nan')):8.1f} us "
            f"floor {rec['floor_replay_us']:.1f} us  check {rec.get('ours_check', '-')} "
            f"err {rec.get('ours_err_out', float('nan')):.1e}  ({rec['shape_s']:.1f} s)")
        write_outputs(results, meta, args)  # keep partial results if the run is cut

    meta["wall_s"] = time.perf_counter() - t_start
    jpath = write_outputs(results, meta, args)
    plots: list[str] = []
    if not args.no_plot:
        try:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import plot_results

            plots = [str(p) for p in plot_results.make_plots(jpath, jpath.parent)]
        except Exception as exc:
            log(f"plots skipped: {_short_error(exc)}")
    n_wrong = sum(1 for r in results if r.get("ours_check") == "WRONG" or r.get("fla_check") == "WRONG")
    n_err = sum(1 for r in results if r.get("error") or r.get("ours_error") or r.get("fla_error"))
    n_skip = sum(1 for r in results if r.get("skipped"))
    log("")
    log(f"== bench_decode {meta['date']} on {props.name}; copy {ctx['copy']['copy_gbps']:.0f} GB/s; "
        f"wall {meta['wall_s']:.0f} s; {len(results) - n_skip}/{len(results)} shapes run, {n_err} with errors, "
        f"{n_wrong} WRONG")
    log(f"== results: {jpath} (+ .csv){' and ' + ', '.join(Path(p).name for p in plots) if plots else ''}")
    log(f"== FLA: {FLA_NOTE}")
    log(f"== advance: {meta['advance_note']}; phase {args.phase}; helion effort {meta['helion_autotune_effort']}")
    log(COLUMN_HELP)
    for line in table_lines(results, [n for n, _ in ctx["baselines"]]):
        log(line)
    return 1 if n_wrong else 0


def _skeleton(shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    cfg = shape.config(args.cache_dtype, args.act_dtype)
    return {"H": shape.H, "HV": shape.HV, "K": shape.K, "V": shape.V, "B": shape.B, "L": shape.L,
            "state": shape.state, "cache": args.cache_dtype, "act": args.act_dtype, "lower_bound": shape.lb,
            "label": shape.label, "bytes_replay": replay_bytes(cfg).total, "bytes_packed": packed_bytes(cfg).total}


if __name__ == "__main__":
    sys.exit(main())
