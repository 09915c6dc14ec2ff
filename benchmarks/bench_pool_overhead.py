#!/usr/bin/env python3
"""Cost of the state pool over the bare op, on one GPU.

1. Graph-captured model steps: ``pool.decode`` for every layer + ``pool.advance`` (with ``--fused-advance`` also
   the step whose last decode moves the cursors, ``decode(..., advance=True)``), against the bare op
   ``tp_replayssm.ops.replayssm_decode`` on tensors of the same shapes, dtypes, ring layout and slot ids (one
   row-indexed cursor tensor per slot set, advanced by one tiny Triton kernel per step: the least a caller can do).
   One graph holds one full cursor cycle (L model steps) per slot set; us/step = median replay / (sets * L);
   ``overhead_pct`` = pool / bare - 1.
2. Eager per-call cost (no graph): CPU time spent inside one call (``host``) and wall time per call with the GPU in
   the loop (``wall``) of ``pool.decode``, the bare op, the same two with the direct launch path off (Helion's own
   dispatch), the op's validation alone (``validation.validate_decode``), the launch without validation or
   planning (``kernels.launch.launch_decode``), ``pool.advance``, and the raw Helion kernel: ``helion.Kernel.__call__``
   is wrapped (class level) for one op call to record the kernel and its arguments, which are then called directly
   (``kernel(*args)``), through the bound kernel (``kernel.bind(args)(*args)``) and through the bound kernel's
   compiled launcher when it has one.

Before timing, one eager ``pool.decode`` step of layer 0 is checked against the float64 plain KDA recurrence
(``tp_replayssm.testing.PlainKDA``) started from ``pool.read_state``.

    python3 benchmarks/bench_pool_overhead.py            # B 32,128,512 x HV 8,32, 4 layers, pre-decayed rings
    python3 benchmarks/bench_pool_overhead.py --quick    # B 128 x HV 8,32

(on the device after ``source benchmarks/device_setup.sh``). Writes ``bench_pool_overhead.json`` (meta and one
record per (B, HV)) into ``--out`` (else ``$OUT``, else ``benchmarks/out/``); the table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

from bench_decode import (  # noqa: E402
    record_failure,
    release_cuda,
    GraphRun,
    _is_fatal_cuda,
    _short_error,
    gather_meta,
    make_advance,
)
from bench_report import log  # noqa: E402
from bench_steps import DTYPES, _rel_err  # noqa: E402
from tp_replayssm.reference import predecay_rings  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="pool.decode + advance vs the bare op (graph and eager).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="B = 128 only")
    p.add_argument("--batch", default="32,128,512")
    p.add_argument("--heads", default="8,32", help="local value heads (H = HV, tp = 1), comma list")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ring", type=int, default=16)
    p.add_argument("--state", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--ring-layout", default="predecayed", choices=["predecayed", "sglang"],
                   help="the pool's ring layout (the bare op runs the same)")
    p.add_argument("--cache-dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="ring dtype (fp16 only with --ring-layout sglang)")
    p.add_argument("--act-dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--lower-bound", type=float, default=None)
    p.add_argument("--key-dim", type=int, default=128)
    p.add_argument("--value-dim", type=int, default=128)
    p.add_argument("--rep-ms", type=float, default=200.0)
    p.add_argument("--min-reps", type=int, default=10)
    p.add_argument("--max-reps", type=int, default=400)
    p.add_argument("--footprint-mb", type=float, default=0.0, help="0 = 4x L2 per replay")
    p.add_argument("--max-graph-steps", type=int, default=2048, help="cap on decode calls in one graph")
    p.add_argument("--fused-advance", action="store_true",
                   help="also time the pool's step with the last layer's decode moving the cursors "
                        "(decode(..., advance=True), no pool.advance): pool_fused_us_step, fused_overhead_pct")
    p.add_argument("--eager-calls", type=int, default=200)
    p.add_argument("--eager-batch", default="1", help="extra batch sizes for the eager table only ('' = none)")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--tol", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new configs after this")
    p.add_argument("--out", help="output folder (default $OUT, else benchmarks/out)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.ring_layout == "predecayed" and args.cache_dtype == "fp16":
        p.error("--cache-dtype fp16 needs --ring-layout sglang (the pre-decayed layout keeps bf16 or fp32 rings)")
    if args.quick:
        args.batch = "128"
    return args


# ----------------------------------------------------------------------------------------------
# raw helion kernel discovery


def record_kernel_calls(call: Callable[[], Any], kernel_cls: type | None = None) -> list[tuple[Any, tuple, dict]]:
    """Run ``call`` once with ``helion.Kernel.__call__`` wrapped (class level, so kernels built on demand
    or cached anywhere are seen); return ``(kernel, args, kwargs)`` of every kernel call it made."""
    if kernel_cls is None:
        from helion.runtime.kernel import Kernel as kernel_cls
    orig = kernel_cls.__call__
    calls: list[tuple[Any, tuple, dict]] = []

    def recording_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((self, args, kwargs))
        return orig(self, *args, **kwargs)

    kernel_cls.__call__ = recording_call
    try:
        call()
        torch.cuda.synchronize()
    finally:
        kernel_cls.__call__ = orig
    return calls


def raw_variants(kernel: Any, args: tuple, kwargs: dict) -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {"kernel_call": lambda: kernel(*args, **kwargs)}
    try:
        nargs = kernel.normalize_args(*args, **kwargs) if kwargs else tuple(args)
        bound = kernel.bind(tuple(nargs))
        out["bound_call"] = lambda: bound(*nargs)
        run = getattr(bound, "_run", None)
        if callable(run):
            out["launcher"] = lambda: run(*nargs)
    except Exception as exc:  # the API moved: keep what works
        log(f"  raw kernel: bind failed ({_short_error(exc)})")
    return out


# ----------------------------------------------------------------------------------------------
# timing


def _direct_plans() -> Any:
    """The decode's direct-launch plan cache (``tp_replayssm.kernels.launch.DIRECT_PLANS``)."""
    from tp_replayssm.kernels import launch

    return launch.DIRECT_PLANS


def _helion_dispatch(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with the direct launch path off (``tp_replayssm.kernels.direct.ENABLED``): Helion's own dispatch."""
    from tp_replayssm.kernels import direct

    def call() -> Any:
        direct.ENABLED = False
        try:
            return fn()
        finally:
            direct.ENABLED = True

    return call


def eager_cost(fn: Callable[[], Any], n: int) -> dict[str, float]:
    """``host_us``: CPU time per call (no sync in the loop); ``wall_us``: per call incl. the GPU."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"host_us": host / n * 1e6, "wall_us": wall / n * 1e6}


# ----------------------------------------------------------------------------------------------
# one config


class Setup:
    """A pool and a bare twin with the same shapes, ring layout, slots and inputs (``ops_fn``: the bare op, SGLang's
    signature with a ``ring_layout`` keyword)."""

    def __init__(self, B: int, HV: int, args: argparse.Namespace, device: torch.device, l2_bytes: int,
                 ops_fn: Callable[..., Any] | None):
        import tp_replayssm as tr

        H, K, V, L, NL = HV, args.key_dim, args.value_dim, args.ring, args.layers
        self.B, self.H, self.HV, self.K, self.V, self.L, self.NL = B, H, HV, K, V, L, NL
        sdt, cdt, adt = DTYPES[args.state], DTYPES[args.cache_dtype], DTYPES[args.act_dtype]
        self.adt = adt
        gen = torch.Generator(device=device)
        gen.manual_seed(args.seed * 7919 + B * 131 + HV)
        self.gen = gen
        per_set = NL * B * (HV * V * K * sdt.itemsize + HV * L * V * cdt.itemsize + H * L * K * cdt.itemsize
                            + HV * L * K * 4)
        target = args.footprint_mb * 2**20 if args.footprint_mb > 0 else 4 * l2_bytes
        max_sets = max(1, args.max_graph_steps // (L * NL))
        self.n_sets = int(max(1, min(math.ceil(target / per_set), max_sets)))
        S = self.n_sets * B
        self.S = S
        self.ring_layout = args.ring_layout
        self.pool = tr.ReplaySSMStatePool(tr.KDAHeads(H, HV, K, V), num_layers=NL, num_slots=S, ring_length=L,
                                          state_dtype=sdt, cache_dtype=cdt, device=device, ring_layout=self.ring_layout)
        self.slots = [self.pool.alloc(B).to(device=device, dtype=torch.int32) for _ in range(self.n_sets)]
        for layer in range(NL):
            for s in self.slots:
                states = torch.randn(B, HV, V, K, device=device, dtype=torch.float32, generator=gen).mul_(0.05)
                self.pool.load_state(layer, s, states)
        self.A_log = [torch.empty(HV, device=device).uniform_(-1.0, 0.5, generator=gen) for _ in range(NL)]
        self.dt_bias = [torch.empty(HV * K, device=device).uniform_(-4.0, 0.0, generator=gen) for _ in range(NL)]
        # bare twin: one checkpoint + rings per layer in the pool's layout, same slot ids, row-indexed cursors per set
        self.bare = []
        predecayed = self.ring_layout == "predecayed"
        for _ in range(NL):
            st = torch.randn(S, HV, V, K, device=device, dtype=sdt, generator=gen).mul_(0.05)
            d = torch.randn(S, HV, L, V, device=device, dtype=cdt, generator=gen).mul_(0.5)
            k = torch.randn(S, HV if predecayed else H, L, K, device=device, dtype=torch.float32, generator=gen)
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            g = torch.rand(S, HV, L, K, device=device, generator=gen).mul_(-0.2).sub_(0.01)
            if predecayed:  # cumulative gates, keys k * exp(-G)
                k, g = predecay_rings(k, g)
            self.bare.append((st, d, k.to(cdt), g))
        self.cursors = [torch.zeros(B, device=device, dtype=torch.int32) for _ in range(self.n_sets)]
        # inputs: one set per (step, layer) of a cycle, shared by the slot sets
        width = 2 * H * K + HV * V
        self.inputs = []
        for _ in range(L * NL):
            self.inputs.append((
                torch.randn(B, width, device=device, dtype=adt, generator=gen),
                torch.randn(B, HV * K, device=device, dtype=adt, generator=gen),
                torch.randn(B, HV, device=device, dtype=adt, generator=gen),
                torch.zeros(B, 1, HV, V, device=device, dtype=adt),
            ))
        self.ops_fn = ops_fn
        self.lb = args.lower_bound
        self.advance = make_advance("triton", L)

    def inp(self, t: int, layer: int):
        return self.inputs[t * self.NL + layer]

    # one model step of one slot set
    def pool_step(self, si: int, t: int, fused: bool = False) -> None:
        for layer in range(self.NL):
            mixed, a, b, out = self.inp(t, layer)
            self.pool.decode(layer, mixed, a, b, self.A_log[layer], self.dt_bias[layer], self.slots[si],
                             lower_bound=self.lb, out=out, advance=fused and layer == self.NL - 1)
        if not fused:
            self.pool.advance(self.slots[si])

    def bare_call(self, si: int, t: int, layer: int) -> None:
        mixed, a, b, out = self.inp(t, layer)
        st, d, k, g = self.bare[layer]
        self.ops_fn(mixed, a, b, self.A_log[layer], self.dt_bias[layer], None, st, d, k, g, out, self.slots[si],
                    self.cursors[si], None, use_qk_l2norm_in_kernel=True, lower_bound=self.lb,
                    ring_layout=self.ring_layout)

    def bare_step(self, si: int, t: int) -> None:
        for layer in range(self.NL):
            self.bare_call(si, t, layer)
        self.advance(self.cursors[si])

    def pool_graph_fn(self, fused: bool = False) -> Callable[[], None]:
        return self._cycles_fn(lambda si, t: self.pool_step(si, t, fused))

    def bare_graph_fn(self) -> Callable[[], None]:
        return self._cycles_fn(self.bare_step)

    def _cycles_fn(self, step: Callable[[int, int], None]) -> Callable[[], None]:
        """Every slot set through one full cursor cycle (L steps), for graph capture."""
        def fn() -> None:
            for si in range(self.n_sets):
                for t in range(self.L):
                    step(si, t)
        return fn

    def check(self) -> float:
        """One eager pool.decode of layer 0 on set 0 vs the float64 plain recurrence from read_state."""
        from tp_replayssm.testing import DecodeInputs, HeadParams, PlainKDA

        slots = self.slots[0]
        before = self.pool.read_state(0, slots)
        plain = PlainKDA(self.B, self.H, self.HV, self.K, self.V)
        plain.load(list(range(self.B)), before)
        mixed = torch.randn(self.B, 2 * self.H * self.K + self.HV * self.V, device=slots.device, dtype=self.adt,
                            generator=self.gen)
        a = torch.randn(self.B, self.HV * self.K, device=slots.device, dtype=self.adt, generator=self.gen)
        b = torch.randn(self.B, self.HV, device=slots.device, dtype=self.adt, generator=self.gen)
        out = torch.full((self.B, 1, self.HV, self.V), float("nan"), device=slots.device, dtype=self.adt)
        got = self.pool.decode(0, mixed, a, b, self.A_log[0], self.dt_bias[0], slots, lower_bound=self.lb, out=out)
        want = plain.step(DecodeInputs(mixed, a, b), HeadParams(self.A_log[0], self.dt_bias[0]),
                          list(range(self.B)), use_qk_l2norm=True, lower_bound=self.lb)
        # keep every layer in step with the shared cursor: decode the other layers too, then advance
        for layer in range(1, self.NL):
            mixed_l, a_l, b_l, out_l = self.inp(0, layer)
            self.pool.decode(layer, mixed_l, a_l, b_l, self.A_log[layer], self.dt_bias[layer], slots,
                             lower_bound=self.lb, out=out_l)
        self.pool.advance(slots)
        torch.cuda.synchronize()
        return _rel_err(got.reshape(self.B, self.HV, self.V).float().cpu(), want.float())


def run_config(B: int, HV: int, args: argparse.Namespace, ctx: dict[str, Any], timed: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"B": B, "HV": HV, "H": HV, "layers": args.layers, "L": args.ring, "state": args.state,
                           "ring_layout": args.ring_layout, "lower_bound": args.lower_bound, "graph": timed}
    su = None
    graphs = []
    try:
        su = Setup(B, HV, args, ctx["device"], ctx["l2_bytes"], ctx["ops"])
        rec.update(n_sets=su.n_sets, S=su.S)
        if not args.no_check:
            try:
                rec["pool_err_out"] = su.check()
                rec["pool_check"] = "ok" if rec["pool_err_out"] <= args.tol else "WRONG"
            except Exception as exc:
                rec["pool_check"] = "ERR"
                rec["check_error"] = _short_error(exc)
                log(f"  [B{B} HV{HV}] check failed: {_short_error(exc)}")
                if _is_fatal_cuda(exc):
                    raise
        rep = (args.rep_ms, args.min_reps, args.max_reps)
        steps = su.n_sets * su.L
        if timed:
            timed_fns = [("bare", su.bare_graph_fn()), ("pool", su.pool_graph_fn())]
            if args.fused_advance:
                timed_fns.append(("pool_fused", su.pool_graph_fn(fused=True)))
            for name, fn in timed_fns:
                try:
                    gr = GraphRun(fn, steps)
                    graphs.append(gr)
                    rec[f"{name}_us_step"] = gr.measure(*rep)["us"]
                except Exception as exc:
                    rec[f"{name}_error"] = _short_error(exc)
                    log(f"  [B{B} HV{HV}] {name} graph failed: {_short_error(exc)}")
                    if args.verbose:
                        log(traceback.format_exc())
                    if _is_fatal_cuda(exc):
                        raise
            if "bare_us_step" in rec and len(graphs) >= 2:  # bare (graphs[0]) again: drift / noise
                rec["bare_us_step_repeat"] = graphs[0].measure(*rep)["us"]
            if "pool_us_step" in rec and "bare_us_step" in rec:
                bare = min(rec["bare_us_step"], rec.get("bare_us_step_repeat", math.inf))
                rec["overhead_pct"] = 100.0 * (rec["pool_us_step"] / bare - 1.0)
                rec["pool_us_layer"] = rec["pool_us_step"] / su.NL
                rec["bare_us_layer"] = bare / su.NL
                if "pool_fused_us_step" in rec:
                    rec["fused_overhead_pct"] = 100.0 * (rec["pool_fused_us_step"] / bare - 1.0)
        # eager, per call
        n = args.eager_calls
        cands: dict[str, Callable[[], Any]] = {
            "pool_decode": lambda: su.pool.decode(0, *su.inp(0, 0)[:3], su.A_log[0], su.dt_bias[0], su.slots[0],
                                                  lower_bound=su.lb, out=su.inp(0, 0)[3]),
            "op": lambda: su.bare_call(0, 0, 0),
            "pool_advance": lambda: su.pool.advance(su.slots[0]),
        }
        # the same calls through Helion's own dispatch (the direct launch path off)
        cands["pool_decode_helion"] = _helion_dispatch(cands["pool_decode"])
        cands["op_helion"] = _helion_dispatch(cands["op"])
        try:  # the op's validation alone, and its launch without validation or planning
            from tp_replayssm.kernels.launch import launch_decode, plan_for
            from tp_replayssm.validation import DecodeCall, validate_decode

            mixed, a, b, out = su.inp(0, 0)
            st, d, k, g = su.bare[0]
            call = DecodeCall(mixed, a, b, su.A_log[0], su.dt_bias[0], None, st, d, k, g, out, su.slots[0],
                              su.cursors[0], None, True, su.lb)
            dims = validate_decode(call, ring_layout=su.ring_layout)
            plan = plan_for(call, dims, ring_layout=su.ring_layout, cursor_table=False, advance=False)
            cands["validate"] = lambda: validate_decode(call, ring_layout=su.ring_layout)
            cands["launch"] = lambda: launch_decode(call, dims, plan)
        except Exception as exc:
            rec["validate_error"] = _short_error(exc)
        try:
            calls = record_kernel_calls(_helion_dispatch(lambda: su.bare_call(0, 0, 0)), ctx.get("kernel_cls"))
            rec["raw_kernel_calls"] = len(calls)
            if calls:
                kernel, kargs, kkw = calls[0]
                for vname, fn in raw_variants(kernel, kargs, kkw).items():
                    cands[f"raw_{vname}"] = fn
            else:
                rec["raw_error"] = "the op made no helion.Kernel call (CPU tensors, or a plan with a register cap: " \
                                   "it launches through Helion's host code)"
        except Exception as exc:
            rec["raw_error"] = _short_error(exc)
        plans = _direct_plans()
        for name, fn in cands.items():
            try:
                hits = plans.hits
                c = eager_cost(fn, n)
                rec[f"{name}_direct_launches"] = plans.hits - hits
                rec[f"{name}_host_us"] = c["host_us"]
                rec[f"{name}_wall_us"] = c["wall_us"]
            except Exception as exc:
                rec[f"{name}_eager_error"] = _short_error(exc)
                log(f"  [B{B} HV{HV}] eager {name} failed: {_short_error(exc)}")
                if _is_fatal_cuda(exc):
                    raise
    except Exception as exc:
        if record_failure(rec, exc, f"B{B} HV{HV}", verbose=args.verbose):
            ctx["fatal"] = rec["error"]
    finally:
        graphs.clear()
        su = None
        release_cuda(ctx)
    rec["config_s"] = time.perf_counter() - t0
    return rec


def _f(v: Any, spec: str, w: int) -> str:
    if not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        return "-".rjust(w)
    return format(v, spec).rjust(w)


def table(results: list[dict[str, Any]]) -> list[str]:
    cols = [("B", "B", "d", 4), ("HV", "HV", "d", 3), ("lay", "layers", "d", 3),
            ("pool_us", "pool_us_step", ".1f", 8), ("bare_us", "bare_us_step", ".1f", 8),
            ("ovh%", "overhead_pct", "+.1f", 6), ("fused_us", "pool_fused_us_step", ".1f", 8),
            ("fovh%", "fused_overhead_pct", "+.1f", 6),
            ("e:pool", "pool_decode_host_us", ".1f", 7), ("e:pool_h", "pool_decode_helion_host_us", ".1f", 8),
            ("e:op", "op_host_us", ".1f", 6), ("e:op_h", "op_helion_host_us", ".1f", 6),
            ("e:valid", "validate_host_us", ".1f", 7), ("e:lnch", "launch_host_us", ".1f", 6),
            ("e:kern", "raw_kernel_call_host_us", ".1f", 6),
            ("e:bound", "raw_bound_call_host_us", ".1f", 7), ("e:raw", "raw_launcher_host_us", ".1f", 6),
            ("e:adv", "pool_advance_host_us", ".1f", 6), ("w:pool", "pool_decode_wall_us", ".1f", 7),
            ("w:op", "op_wall_us", ".1f", 7), ("err", "pool_err_out", ".0e", 6)]
    head = " ".join(h.rjust(w) for h, _, _, w in cols) + "  chk"
    lines = [head, "-" * len(head)]
    for r in results:
        line = " ".join(_f(r.get(k), s, w) for _, k, s, w in cols) + f"  {r.get('pool_check', '-')}"
        err = r.get("error") or r.get("skipped") or r.get("pool_error") or r.get("bare_error")
        if err:
            line += f"  !{err[:70]}"
        lines.append(line)
    return lines


HELP = """\
pool_us / bare_us: us per model step (all layers + cursor advance), graph-captured, median replay of full cursor
cycles; ovh% = pool_us / bare_us - 1 (bare: the smaller of two timings). e:* = eager CPU us per call (no sync in the
loop): pool.decode, the same through Helion's dispatch (pool_h: the direct launch path off), the bare op
(op_h: the same), its input validation alone, kernels.launch.launch_decode (the op minus validation and planning),
the raw Helion kernel via kernel(*args) / kernel.bind(args)(*args) / the bound kernel's compiled launcher (_run),
pool.advance. w:* = eager wall us per call (GPU in the loop). err = rel. error of one pool.decode out vs the
float64 plain recurrence from pool.read_state."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("bench_pool_overhead: no CUDA device is visible (torch.cuda.is_available() is False); "
            "this benchmark runs on the GPU machine only.")
        return 2
    t_start = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    l2_bytes = int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)
    meta = gather_meta(argparse.Namespace(**{**vars(args), "advance": "bare: row cursors + a Triton advance"}), argv)
    meta["command"] = " ".join(["bench_pool_overhead.py", *argv])
    meta.update(gpu=props.name, l2_bytes=l2_bytes)
    from tp_replayssm import ops

    ctx: dict[str, Any] = {"device": device, "l2_bytes": l2_bytes, "ops": ops.replayssm_decode}
    log(f"bench_pool_overhead: {props.name}; layers {args.layers}, L {args.ring}, state {args.state}, "
        f"{args.ring_layout} ring layout")
    results = []
    configs = [(int(B), int(HV), True) for HV in args.heads.split(",") for B in args.batch.split(",")]
    configs += [(int(B), int(HV), False) for HV in args.heads.split(",") for B in args.eager_batch.split(",")
                if B.strip()]
    for B, HV, timed in configs:
        if ctx.get("fatal"):
            results.append({"B": B, "HV": HV, "layers": args.layers, "skipped": f"CUDA broken: {ctx['fatal'][:60]}"})
            continue
        if time.perf_counter() - t_start > args.budget_s:
            results.append({"B": B, "HV": HV, "layers": args.layers, "skipped": "time budget"})
            continue
        rec = run_config(B, HV, args, ctx, timed)
        results.append(rec)
        log(f"B{B} HV{HV}{'' if timed else ' (eager only)'}: pool {rec.get('pool_us_step', float('nan')):.1f} us/step, "
            f"bare {rec.get('bare_us_step', float('nan')):.1f}, overhead {rec.get('overhead_pct', float('nan')):+.1f}%, "
            f"check {rec.get('pool_check', '-')} ({rec['config_s']:.1f} s)")
    meta["wall_s"] = time.perf_counter() - t_start
    d = Path(args.out) if args.out else Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "out"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "bench_pool_overhead.json"
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    log("")
    log(f"== bench_pool_overhead {datetime.date.today()} on {props.name}; wall {meta['wall_s']:.0f} s; {path}")
    log(HELP)
    for line in table(results):
        log(line)
    return 1 if any(r.get("pool_check") == "WRONG" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
