#!/usr/bin/env python3
"""KDA ReplaySSM decode on one GPU, ours against FLA 0.6.0's packed in-place decode
(``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd``), graph-captured and averaged over full cursor cycles.

What it measures, per shape:

- ``ours_us``: ours as the pool runs it, us/step: the decode reading the pool's slot-indexed cursor table
  (:func:`tp_replayssm.kernels.launch.run_decode` with ``cursor_table=True``, what ``ReplaySSMStatePool.decode``
  calls), then the pool's cursor advance (:func:`tp_replayssm.kernels.cursor.advance`). ONE CUDA graph holds, for
  each of ``n_sets`` disjoint slot sets, one full cursor cycle: ``L`` steps with cursors ``0 .. L-1`` (the last
  one flushes); us/step = median replay time / (n_sets * L). Enough slot sets that one replay touches 4x the L2
  (``--footprint-mb``), and each step reads its own input set where memory allows.
- ``ours_op_us``: the op alone (row cursors, a constant ``write_pos`` per step, no advance kernel);
  ``ours_fused_us`` (``--fused-advance``): the decode moving the cursors itself (the pool's
  ``decode(..., advance=True)``); ``ours_eager_us`` / ``ours_host_us``: one cycle without a graph.
- ``fla_us``: FLA on the same slot sets and inputs, one in-place packed step per (set, step), graph-captured.
  Gate (``A_log``, ``dt_bias``, ``lower_bound``), beta sigmoid and q/k l2norm run inside FLA's kernel; FLA needs
  ``q, k, v`` as separate contiguous tensors, so they are split from ``mixed_qkv`` once, outside the timed region
  (FLA gets its best case). ``speedup_vs_fla = fla_us / ours_us``: below 1.0 FLA is faster at that shape; the
  table's ``win`` column and its last line say where.
- ``--replay-op [NAME=]MODULE:FN`` (repeatable): an extra op with SGLang's signature (e.g. a port of SGLang's
  kernel) on rings in SGLang's layout, timed like ours' op on row cursors (advanced by a small Triton kernel in
  the graph): ``NAME_us``, ``NAME_op_us``, ``speedup_vs_NAME``.
- Correctness before timing: one step of each op against :mod:`tp_replayssm.reference` on copies of the pool
  (random cursors with a flush row and, for B >= 4, a padding row; ``out`` poisoned with NaN first): rel. errors of
  ``out``, flushed checkpoints and appended ring entries; untouched checkpoints and zero padding rows. FLA's ``out``
  is checked against the reference at an empty ring.
- Bytes: :mod:`tp_replayssm.kernels.byte_model` (cycle mean for ours, state read + write every step for FLA);
  ``%floor = (model bytes / measured copy bandwidth) / measured time``.

``--ring-layout`` picks ours' ring layout (``predecayed``, the pool's default, or ``sglang``). ``--override
field=value,...`` times ours with the library's launch plan of every shape with those ``DecodePlan`` fields
replaced (``benchmarks/plan_args.py``, e.g. ``value_tile=64,num_warps=1`` or ``tiny_batch=true``); every shape's
plan is checked before any GPU work.

Commands (the device: ``source benchmarks/device_setup.sh`` first; ``benchmarks/run_device_bench.sh`` runs the
baseline table)::

    python3 benchmarks/bench_decode.py                      # the standard shapes (budget 400 s)
    python3 benchmarks/bench_decode.py --quick              # 8 shapes, < 2 min
    python3 benchmarks/bench_decode.py --heads 32 --batch 512 --state bf16 --override value_tile=64
    python3 benchmarks/bench_decode.py --dry-run            # shapes, byte floors and launch plans; any machine

Writes ``<tag>.json`` (meta and one record per shape) and ``<tag>.csv`` into ``--out`` (else ``$OUT``, else
``benchmarks/out/``), with matplotlib the PNG plots of ``plot_results.py`` beside them, and prints the compact table
last. The shape lists are in ``bench_shapes.py``, buffers, step closures and checks in ``bench_steps.py``, the
table, files and dry run in ``bench_report.py``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # the package, and the bench_* modules beside this file
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

if __name__ == "__main__":
    # before anything imports helion: the library's kernels are pinned, but an extra op (--replay-op) built on an
    # unpinned Helion kernel would otherwise autotune in the middle of the sweep
    os.environ.setdefault("HELION_AUTOTUNE_EFFORT", "none")

import torch  # noqa: E402

from bench_report import COLUMN_HELP, dry_run, fla_summary, log, plan_label, table_lines, write_outputs  # noqa: E402
from bench_shapes import Shape, shapes_from_args  # noqa: E402
from bench_steps import Buffers, check_fla, check_replay, fla_steps, ours_op, pool_steps, replay_steps, run_steps  # noqa: E402
from plan_args import override_arg  # noqa: E402
from tp_replayssm.kernels.byte_model import floor_us, packed_bytes, replay_bytes  # noqa: E402

try:  # the row cursors' advance of the extra ops; without triton, torch ops
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


FLA_SPEC = "fla.ops.kda.fused_recurrent:fused_recurrent_kda_fwd"
FLA_NOTE = ("FLA 0.6.0 fused_recurrent_kda_fwd(inplace_final_state=True, state_v_first=True, "
            "ssm_state_indices, use_gate_in_kernel, use_beta_sigmoid_in_kernel, use_qk_l2norm_in_kernel "
            "as ours, lower_bound as ours); q/k/v pre-split into contiguous tensors outside the timed region")
ADVANCE_NOTES = {
    "pool": "ours: run_decode on the pool's slot-indexed cursor table, then the pool's cursor advance "
            "(tp_replayssm.kernels.cursor.advance), in the graph; extra ops: row cursors and one small Triton "
            "advance kernel per step (c -> 0 if c >= L-1 else c+1)",
    "none": "no advance; constant write_pos tensors per step (ours: the op alone)",
}


# ----------------------------------------------------------------------------------------------
# arguments


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="KDA ReplaySSM decode benchmark (ours vs FLA packed decode), cycle-averaged, graph-captured.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("shapes (any of these switches to a cross-product grid)")
    g.add_argument("--quick", action="store_true", help="8 shapes, < 2 minutes")
    g.add_argument("--heads", help="comma list of HV (H = HV) or HxHV for GQA, e.g. '32,8,16x32' [grid default 32,8]")
    g.add_argument("--batch", help="comma list of B [grid default 1,8,32,128,512]")
    g.add_argument("--state", help="comma list of state dtypes fp32,bf16 [grid default both]")
    g.add_argument("--ring", help="comma list of ring lengths L [grid default 16]")
    g.add_argument("--lower-bound", help="comma list: none and/or numbers, e.g. 'none,-5' [grid default none]")
    g.add_argument("--key-dim", type=int, default=128)
    g.add_argument("--value-dim", type=int, default=128)
    g.add_argument("--start-at", type=int, default=0, help="skip the first N shapes (resume a cut sweep)")
    g.add_argument("--max-shapes", type=int, default=0, help="then keep only the first N shapes (0 = all)")
    g.add_argument("--cache-dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="ring dtype (fp16 only with --ring-layout sglang)")
    g.add_argument("--act-dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="activation dtype")

    m = p.add_argument_group("method")
    m.add_argument("--only", choices=["both", "ours", "fla"], default="both",
                   help="which side to run (the --replay-op ops go with ours)")
    m.add_argument("--ring-layout", choices=["predecayed", "sglang"], default="predecayed",
                   help="ours' ring layout: the pool's default pre-decayed one (cumulative gates, keys pre-decayed, "
                        "one per value head) or SGLang's")
    m.add_argument("--replay-op", action="append", default=[], metavar="[NAME=]MODULE:FN",
                   help="an extra op with SGLang's signature (e.g. a port of SGLang's kernel) on SGLang-layout "
                        "rings, timed like ours' op on row cursors (repeatable; NAME defaults to FN)")
    m.add_argument("--override", type=override_arg, default={}, metavar="FIELD=VALUE,...",
                   help="replace these fields of the library's launch plan of every shape for ours, e.g. "
                        "'value_tile=64,num_warps=1', 'tiny_batch=true', 'vector_tiles=0', 'maxnreg=none' "
                        "(DecodePlan's fields; benchmarks/plan_args.py)")
    m.add_argument("--A-log-shift", type=float, default=0.0,
                   help="added to every head's A_log: gates exp(shift) times stronger (in the pre-decayed layout, "
                        "heads whose cumulative gate passes -75 rebase: the worst case of unbounded gates)")
    m.add_argument("--advance", choices=list(ADVANCE_NOTES), default="pool",
                   help="pool: ours is the pool's step (cursor table + the pool's advance kernel), extra ops advance "
                        "row cursors with a small Triton kernel; none: constant write_pos per step, no advance")
    m.add_argument("--fused-advance", action="store_true",
                   help="with --advance pool: also time ours with the advance fused into the decode (the pool's "
                        "decode(..., advance=True) on a step's last layer): ours_fused_us")
    m.add_argument("--phase", choices=["sync", "stagger"], default="sync",
                   help="sync: all rows at the same cursor; stagger: row b starts at b %% L")
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
                   help="stop starting new shapes after this many seconds (0 = 400 standard shapes, 80 quick)")

    o = p.add_argument_group("output")
    o.add_argument("--out", help="output folder (default $OUT, else benchmarks/out)")
    o.add_argument("--tag", default="bench_decode", help="file name stem of the outputs")
    o.add_argument("--no-plot", action="store_true", help="do not write PNG plots")
    o.add_argument("--dry-run", action="store_true",
                   help="print the shapes, model byte floors and launch plans; no GPU needed")
    o.add_argument("--assume-bw", type=float, default=4300.0, help="copy bandwidth (GB/s) for --dry-run floors")
    o.add_argument("-v", "--verbose", action="store_true", help="print full tracebacks")
    args = p.parse_args(argv)
    if args.ring_layout == "predecayed" and args.cache_dtype == "fp16":
        p.error("--cache-dtype fp16 needs --ring-layout sglang (the pre-decayed layout keeps bf16 or fp32 rings)")
    if args.fused_advance and args.advance != "pool":
        p.error("--fused-advance times the pool's step: it needs --advance pool")
    for spec in args.replay_op:
        if ":" not in replay_op_name(spec)[1]:
            p.error(f"--replay-op: expected [NAME=]MODULE:FN; got {spec!r}")
    if not args.budget_s:
        args.budget_s = 80.0 if args.quick else 400.0
    return args


def replay_op_name(spec: str) -> tuple[str, str]:
    """``(name, "module:function")`` of a ``--replay-op`` value (the name defaults to the function's)."""
    name, eq, target = spec.partition("=")
    if not eq:
        name, target = spec.rpartition(":")[2].rpartition(".")[2], spec
    return name.strip(), target.strip()


def plans_for(shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    """Ours' launch plans at ``shape`` with ``--override`` applied: ``"op"`` (row cursors), ``"pool"`` (the cursor
    table) and, with ``--fused-advance``, ``"fused"``. ``ValueError`` naming the shape when a plan cannot run it."""
    from plan_args import build_plan

    kw = dict(batch=shape.B, heads=shape.HV, q_heads=shape.H, key_dim=shape.K, value_dim=shape.V,
              ring_length=shape.L, state=shape.state, cache=args.cache_dtype, layout=args.ring_layout,
              lower_bound=shape.lb, use_l2norm=not args.no_l2norm, override=args.override)
    kinds = {"op": dict(cursor_table=False), "pool": dict(cursor_table=True)}
    if args.fused_advance:
        kinds["fused"] = dict(cursor_table=True, advance=True)
    try:
        return {name: build_plan(**kw, **extra) for name, extra in kinds.items()}
    except ValueError as exc:
        raise ValueError(f"{shape.label}: {exc}") from None


# ----------------------------------------------------------------------------------------------
# timing primitives


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
    """In-place cursor advance of a row-indexed int32 cursor tensor, ``c -> 0 if c >= L-1 else c+1``: one small
    Triton kernel per call (``mode`` "triton", on CUDA tensors), else torch ops; None for ``mode`` "none"."""
    if mode == "none":
        return None

    def advance(cursor: torch.Tensor) -> None:
        if mode == "triton" and triton is not None and cursor.is_cuda:
            n = cursor.numel()
            _advance_cursor_kernel[(triton.cdiv(n, 1024),)](cursor, n, L - 1, BLOCK=1024)
        else:
            cursor.add_(1)
            cursor.remainder_(L)
    return advance


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
    rec = _skeleton(shape, args)
    rb, pb = rec["bytes_replay"], rec["bytes_packed"]
    rec.update(floor_replay_us=floor_us(rb, bw), floor_packed_us=floor_us(pb, bw))
    l2norm = not args.no_l2norm
    rep = (args.rep_ms, args.min_reps, args.max_reps)
    plans = ctx["plans"][shape]
    rec["plan"] = plan_label(plans["pool" if args.advance == "pool" else "op"])
    chosen = (lambda kind: plans.get(kind)) if args.override else (lambda kind: None)  # None: the library's own
    pool = args.advance == "pool"
    buf = sglang_buf = None
    graphs: list[GraphRun] = []
    timed: dict[str, GraphRun] = {}

    def graph(make: Callable[..., Any]) -> GraphRun:
        steps = make()
        gr = GraphRun(run_steps(steps), len(steps))
        graphs.append(gr)
        return gr

    def measure(name: str, steps: Callable[..., Any], op_steps: Callable[..., Any] | None,
                fused: Callable[..., Any] | None, check: Callable[[], dict[str, Any]] | None) -> None:
        """Check, then time ``steps()`` (``<name>_us``), ``fused()`` (``<name>_fused_us``), ``op_steps()``
        (``<name>_op_us``; None: the same as ``steps``) and one eager cycle of ``steps(sets=[0])``."""
        if check is not None and not args.no_check:
            chk = check()
            for k, v in chk.items():
                rec[f"{name}_{k}"] = v
            worst = max(chk["err_out"], chk["err_state"], chk["err_ring"])
            ok = worst <= args.tol and chk["pad_ok"] and chk["untouched_ok"]
            rec[f"{name}_check"] = "ok" if ok else "WRONG"
        gr = graph(steps)
        rec.update({f"{name}_{k}": v for k, v in gr.measure(*rep).items()})
        if name == "ours":
            timed["ours"] = gr
        if fused is not None:
            rec[f"{name}_fused_us"] = graph(fused).measure(*rep)["us"]
        rec[f"{name}_op_us"] = graph(op_steps).measure(*rep)["us"] if op_steps is not None else rec[f"{name}_us"]
        if not args.no_eager:
            e = time_eager(steps(sets=[0]), args.rep_ms)
            rec[f"{name}_eager_us"] = e["us"]
            rec[f"{name}_host_us"] = e["host_us"]
        rec[f"{name}_gbps"] = rb / (rec[f"{name}_us"] * 1e-6) / 1e9
        rec[f"{name}_pct_floor"] = 100.0 * rec["floor_replay_us"] / rec[f"{name}_us"]

    try:
        buf = Buffers(shape, args, dev, ctx["l2_bytes"], need_fla=ctx["fla"] is not None)
        rec.update(n_sets=buf.n_sets, S=buf.S, graph_steps=buf.n_steps, n_inputs=buf.n_in,
                   footprint_mb=buf.footprint / 2**20)
        if ctx["ours"]:
            try:
                op = ours_op(args.ring_layout, chosen("op"))
                op_steps = functools.partial(replay_steps, op, buf, shape, l2norm=l2norm, advance=None)
                if pool:
                    steps = functools.partial(pool_steps, buf, shape, l2norm=l2norm, plan=chosen("pool"))
                    fused = functools.partial(pool_steps, buf, shape, l2norm=l2norm, fused=True,
                                              plan=chosen("fused")) if args.fused_advance else None
                else:
                    steps, op_steps, fused = op_steps, None, None
                measure("ours", steps, op_steps, fused,
                        lambda: check_replay(op, ctx["ref"][args.ring_layout], buf, shape, l2norm))
            except Exception as exc:  # record and go on with the other implementations
                if record_failure(rec, exc, shape.label, "ours", args.verbose):
                    raise
        for name, fn in ctx["replay_ops"]:
            try:
                if args.ring_layout == "sglang":
                    sglang_buf = buf
                elif sglang_buf is None:
                    sglang_buf = Buffers(shape, args, dev, ctx["l2_bytes"], need_fla=False, ring_layout="sglang")
                b = sglang_buf
                advance = make_advance("triton" if pool else "none", shape.L)
                steps = functools.partial(replay_steps, fn, b, shape, l2norm=l2norm, advance=advance)
                op_steps = functools.partial(replay_steps, fn, b, shape, l2norm=l2norm, advance=None) if pool \
                    else None
                measure(name, steps, op_steps, None,
                        lambda fn=fn, b=b: check_replay(fn, ctx["ref"]["sglang"], b, shape, l2norm))
            except Exception as exc:
                if record_failure(rec, exc, shape.label, name, args.verbose):
                    raise
        if ctx["fla"] is not None:
            fla = ctx["fla"]
            try:
                if not args.no_check:
                    rec["fla_err_out"] = check_fla(fla, ctx["ref"][args.ring_layout], buf, shape, l2norm)
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
        if "ours" in timed and not args.no_repeat:
            rec["ours_us_repeat"] = timed["ours"].measure(*rep)["us"]
            rec["ours_spread_pct"] = 100.0 * abs(rec["ours_us_repeat"] - rec["ours_us"]) / rec["ours_us"]
        if "ours_us" in rec and "fla_us" in rec:
            rec["speedup_vs_fla"] = rec["fla_us"] / rec["ours_us"]  # below 1: FLA is faster
            rec["op_speedup_vs_fla"] = rec["fla_us"] / rec["ours_op_us"]
            if "ours_fused_us" in rec:
                rec["fused_speedup_vs_fla"] = rec["fla_us"] / rec["ours_fused_us"]
        for name, _ in ctx["replay_ops"]:
            if "ours_us" in rec and f"{name}_us" in rec:
                rec[f"speedup_vs_{name}"] = rec[f"{name}_us"] / rec["ours_us"]
    except Exception as exc:
        if record_failure(rec, exc, shape.label, verbose=args.verbose):
            ctx["fatal"] = rec["error"]
    finally:
        timed.clear()
        graphs.clear()  # the graphs, the step closures and the buffers go before the cache is emptied
        buf = sglang_buf = b = op = steps = op_steps = fused = gr = None
        release_cuda(ctx)
    rec["shape_s"] = time.perf_counter() - t_shape
    return rec


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
        "advance_note": ADVANCE_NOTES.get(args.advance, args.advance),
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    shapes = shapes_from_args(args)
    try:  # every shape's plan, before any GPU work: a bad --override fails here
        plans = {shape: plans_for(shape, args) for shape in shapes}
    except ValueError as exc:
        log(f"bench_decode: --override does not fit a shape: {exc}")
        return 2
    if args.dry_run:
        dry_run(shapes, args, plans.__getitem__)
        return 0
    if not torch.cuda.is_available():
        log("bench_decode: no CUDA device is visible (torch.cuda.is_available() is False); this benchmark "
            "runs on the GPU machine only. Use --dry-run to print the shapes and the model's byte floors here.")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t_start = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    meta = gather_meta(args, argv)
    meta.update(gpu=props.name, sm_count=props.multi_processor_count, l2_bytes=l2_bytes,
                gpu_mem_gib=props.total_memory / 2**30, ring_layout=args.ring_layout, override=args.override)
    log(f"bench_decode: {props.name}, {props.multi_processor_count} SMs, L2 {l2_bytes / 2**20:.0f} MiB; "
        f"torch {torch.__version__}, triton {meta['triton']}, helion {meta['helion']}, fla {meta['fla_core']}")
    log(f"{len(shapes)} shapes, budget {args.budget_s:.0f} s, {args.ring_layout} ring layout, advance={args.advance}, "
        f"phase={args.phase}, l2norm={not args.no_l2norm}, override={args.override or 'none'}")

    from tp_replayssm import reference

    ctx: dict[str, Any] = {"device": device, "l2_bytes": l2_bytes, "plans": plans, "fla": None, "replay_ops": [],
                           "ours": args.only in ("both", "ours"),
                           "ref": {layout: functools.partial(reference.replayssm_decode, ring_layout=layout)
                                   for layout in ("predecayed", "sglang")}}
    if ctx["ours"]:
        for spec in args.replay_op:
            name, target = replay_op_name(spec)
            try:
                ctx["replay_ops"].append((name, load_callable(target)))
            except Exception as exc:
                meta[f"{name}_import_error"] = _short_error(exc)
                log(f"replay op {name}: cannot import {target}: {_short_error(exc)}")
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
    for i, shape in enumerate(shapes):
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
        log(f"[{i + 1}/{len(shapes)}] {shape.label:26s} ours {rec.get('ours_us', float('nan')):8.1f} us "
            f"(op {rec.get('ours_op_us', float('nan')):.1f}, fused {rec.get('ours_fused_us', float('nan')):.1f}) "
            f"fla {rec.get('fla_us', float('nan')):8.1f} us  xFLA {rec.get('speedup_vs_fla', float('nan')):.2f} "
            f"floor {rec['floor_replay_us']:.1f} us  check {rec.get('ours_check', '-')} "
            f"err {rec.get('ours_err_out', float('nan')):.1e}  [{rec.get('plan', '-')}] ({rec['shape_s']:.1f} s)")
        write_outputs(results, meta, args)  # keep partial results if the run is cut

    meta["wall_s"] = time.perf_counter() - t_start
    meta["fla_summary"] = fla_summary(results)
    jpath = write_outputs(results, meta, args)
    plots: list[str] = []
    if not args.no_plot:
        try:
            import plot_results

            plots = [str(p) for p in plot_results.make_plots(jpath, jpath.parent)]
        except Exception as exc:
            log(f"plots skipped: {_short_error(exc)}")
    n_wrong = sum(1 for r in results if any(v == "WRONG" for k, v in r.items() if k.endswith("_check")))
    n_err = sum(1 for r in results if any(k == "error" or k.endswith("_error") for k in r))
    n_skip = sum(1 for r in results if r.get("skipped"))
    log("")
    log(f"== bench_decode {meta['date']} on {props.name}; copy {ctx['copy']['copy_gbps']:.0f} GB/s; "
        f"wall {meta['wall_s']:.0f} s; {len(results) - n_skip}/{len(results)} shapes run, {n_err} with errors, "
        f"{n_wrong} WRONG")
    log(f"== results: {jpath} (+ .csv){' and ' + ', '.join(Path(p).name for p in plots) if plots else ''}")
    log(f"== FLA: {FLA_NOTE}")
    log(f"== {args.ring_layout} ring layout; advance: {meta['advance_note']}; phase {args.phase}; "
        f"override {args.override or 'none'}")
    log(COLUMN_HELP)
    for line in table_lines(results, [n for n, _ in ctx["replay_ops"]]):
        log(line)
    return 1 if n_wrong else 0


def _skeleton(shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    cfg = shape.config(args.cache_dtype, args.act_dtype, args.ring_layout)
    return {"ring_layout": args.ring_layout, "H": shape.H, "HV": shape.HV, "K": shape.K, "V": shape.V,
            "B": shape.B, "L": shape.L, "state": shape.state, "cache": args.cache_dtype, "act": args.act_dtype,
            "lower_bound": shape.lb, "label": shape.label, "bytes_replay": replay_bytes(cfg).total,
            "bytes_packed": packed_bytes(cfg).total}


if __name__ == "__main__":
    sys.exit(main())
