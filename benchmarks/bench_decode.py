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
of ``benchmarks/plot_results.py``. The compact table is printed last. The shape plans live in
``bench_plan.py``, the buffers, step closures and checks in ``bench_steps.py``, the table, files and dry
run in ``bench_report.py``; this file times them.
"""

from __future__ import annotations

import argparse
import datetime
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

if __name__ == "__main__" and "--allow-autotune" not in sys.argv[1:]:
    # before anything imports helion: an unpinned kernel compiles its default config instead of
    # autotuning in the middle of the sweep (the run must fit its time budget)
    os.environ.setdefault("HELION_AUTOTUNE_EFFORT", "none")

import torch  # noqa: E402

from bench_plan import Shape, build_plan  # noqa: E402
from bench_report import COLUMN_HELP, dry_run, log, table_lines, write_outputs  # noqa: E402
from bench_steps import Buffers, check_fla, check_replay, fla_steps, replay_steps, run_steps  # noqa: E402
from launch_args import FORMAT, SWITCH_CHOICES, launch_spec_arg, switch  # noqa: E402
from tp_replayssm.byte_model import floor_us, packed_bytes, replay_bytes  # noqa: E402

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


OURS_SPEC = "tp_replayssm.ops:replayssm_decode"
OURS_PREDECAYED = "tp_replayssm.ops:replayssm_decode_predecayed"
FLA_SPEC = "fla.ops.kda.fused_recurrent:fused_recurrent_kda_fwd"
FLA_NOTE = ("FLA 0.6.0 fused_recurrent_kda_fwd(inplace_final_state=True, state_v_first=True, "
            "ssm_state_indices, use_gate_in_kernel, use_beta_sigmoid_in_kernel, use_qk_l2norm_in_kernel "
            "as ours, lower_bound as ours); q/k/v pre-split into contiguous tensors outside the timed region")


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
    m.add_argument("--ring-layout", choices=["spec", "predecayed"], default="spec",
                   help="the rings' layout: SPEC section 1's, or the pool's pre-decayed one (ring_layout='predecayed'; "
                        "ours becomes ops.replayssm_decode_predecayed, the check its reference; any gate)")
    m.add_argument("--A-log-shift", type=float, default=0.0,
                   help="added to every head's A_log: gates exp(shift) times stronger (in the pre-decayed layout, "
                        "heads whose cumulative gate passes -75 rebase: the worst case of unbounded gates)")
    m.add_argument("--baseline", action="append", default=[], metavar="NAME=module:function",
                   help="extra replay op with the same signature (e.g. a port of SGLang's kernel), timed like ours")
    m.add_argument("--advance", choices=["pool", "triton", "torch", "none"], default="pool",
                   help="cursor advance after each step inside the graph. pool: ours reads the pool's slot-indexed "
                        "cursor table (ops.decode_with_cursor_table) and advances it with the pool's kernel "
                        "(cursor_kernel.advance), as ReplaySSMStatePool.decode/advance do (other ops: triton); "
                        "triton: a row-indexed cursor and a small Triton kernel (sessions 1-7); "
                        "none: constant write_pos per step")
    m.add_argument("--fused-advance", action="store_true",
                   help="with --advance pool: also time ours with the advance fused into the decode (the pool's "
                        "decode(..., advance=True) on a step's last layer): ours_fused_us")
    m.add_argument("--tiny-batch", choices=SWITCH_CHOICES, default="auto",
                   help="the kernel's tiny-batch path (whole-ring loads that do not wait for the cursor): the library's "
                        "choice (configs.tiny_batch), or forced on / off for every shape")
    m.add_argument("--count-after-loads", choices=SWITCH_CHOICES, default="auto",
                   help="with --fused-advance: where each program counts itself (configs.count_after_loads): the "
                        "library's choice, after its ring and input loads (on), or as the atomic cursor read (off)")
    m.add_argument("--vector-tiles", choices=("auto", "0", "1", "2"), default="auto",
                   help="the kernel's vector tiles (configs.vector_tiles): the library's choice, or forced to 0 (none), "
                        "1 (the append loop's) or 2 (and the pre-decayed key tiles) on every register-chunk shape")
    m.add_argument("--config", default=None, metavar=FORMAT, type=launch_spec_arg,
                   help="force one launch choice on every shape (configs.FORCED; benchmarks/launch_args.py): value "
                        "tile, value chunk, warps per program, then optionally a register cap (0: none), a persistent "
                        "grid's programs per SM (0: none) and 'mma' for the tensor-core chunk path (bf16 checkpoint "
                        "and rings); default the library's configs.select_config")
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
    cfg = shape.config(args.cache_dtype, args.act_dtype, keys_per_value_head=args.ring_layout == "predecayed")
    rb, pb = replay_bytes(cfg).total, packed_bytes(cfg).total
    rec: dict[str, Any] = {
        "ring_layout": args.ring_layout,
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
                pool = args.advance == "pool" and name == "ours" and args.ours in (OURS_SPEC, OURS_PREDECAYED)
                gr = GraphRun(run_steps(replay_steps(fn, buf, shape, l2norm=l2norm, advance=advance, pool=pool)),
                              buf.n_steps)
                graphs.append(gr)
                t = gr.measure(*rep)
                rec.update({f"{name}_{k}": v for k, v in t.items()})
                if name == "ours":
                    ours_graph = gr
                if pool and args.fused_advance:
                    grf = GraphRun(run_steps(replay_steps(fn, buf, shape, l2norm=l2norm, advance=advance, pool=True,
                                                          fused=True)), buf.n_steps)
                    graphs.append(grf)
                    rec["ours_fused_us"] = grf.measure(*rep)["us"]
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
            if "ours_fused_us" in rec:
                rec["fused_speedup_vs_fla"] = rec["fla_us"] / rec["ours_fused_us"]
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    plan = build_plan(args)
    if args.ring_layout == "predecayed" and args.ours == OURS_SPEC:
        args.ours = OURS_PREDECAYED
    if args.dry_run:
        dry_run(plan, args)
        return 0
    if not torch.cuda.is_available():
        log("bench_decode: no CUDA device is visible (torch.cuda.is_available() is False); this benchmark "
            "runs on the GPU machine only. Use --dry-run to print the plan and the model's byte floors here.")
        return 2
    from tp_replayssm import configs

    configs.FORCED_TINY_BATCH = switch(args.tiny_batch)
    configs.FORCED_COUNT_AFTER_LOADS = switch(args.count_after_loads)
    configs.FORCED_VECTOR_TILES = None if args.vector_tiles == "auto" else int(args.vector_tiles)
    if args.config:
        configs.FORCED = args.config.launch_choice()
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
    from tp_replayssm import reference as reference_module

    reference = (reference_module.replayssm_decode_predecayed if args.ring_layout == "predecayed"
                 else reference_module.replayssm_decode)

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
            f"(op {rec.get('ours_op_us', float('nan')):.1f}, fused {rec.get('ours_fused_us', float('nan')):.1f}) "
            f"fla {rec.get('fla_us', float('nan')):8.1f} us "
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
    cfg = shape.config(args.cache_dtype, args.act_dtype, keys_per_value_head=args.ring_layout == "predecayed")
    return {"H": shape.H, "HV": shape.HV, "K": shape.K, "V": shape.V, "B": shape.B, "L": shape.L,
            "state": shape.state, "cache": args.cache_dtype, "act": args.act_dtype, "lower_bound": shape.lb,
            "label": shape.label, "bytes_replay": replay_bytes(cfg).total, "bytes_packed": packed_bytes(cfg).total}


if __name__ == "__main__":
    sys.exit(main())
