"""One layer's pool decode step on a GPU, graph-captured and averaged over a full ring cycle.

Times ``pool.decode`` + ``pool.advance`` (or, with ``--fused``, ``pool.decode(..., advance=True)``; with ``--forms
advance``, ``pool.advance`` alone: the cursor kernel, which an engine runs once per model step; with ``--forms
decode``, ``pool.decode`` alone) for one layer as an engine runs it: each graph holds one full cursor cycle (L steps,
the last one flushes) of one slot set, and the replays rotate over enough disjoint slot sets that the state streams
from HBM (8x the L2). us/step = median replay time / L. The plain decode alone cannot move its own cursors, so its
form holds one graph per cursor phase (one decode of every slot set; the cursors are moved between phases, outside
the timing) and averages the L phases' medians. ``--layers N`` times a model step of N layers (N decodes, then the
advance, or the last decode fused with it) and reports us per layer step; ``--settle`` frees the previous shape's
memory and graphs (``gc.collect``, ``torch.cuda.empty_cache``) before each shape; ``--conv W`` gives the pool a conv
of kernel W and every decode pre-conv ``mixed_qkv`` with ``conv_weight``/``conv_bias`` (the library's plan: fused from
256 pairs, else the conv's own launch; docs/conv.md), so the conv's cost reads against the same command without it;
``--override`` / ``--fused-override`` replace fields of the plain / fused decodes' launch plans (``plan_args.py``: the
library's plan of each shape with those fields changed and checked), to time a plan choice without another package.
It uses only the pool's public API, so the same script times any version of the library on the path:
an A/B of a kernel change runs it twice, once with the other checkout first on PYTHONPATH.

    python benchmarks/bench_pool_step.py --out step.json                  # the standard shapes
    python benchmarks/bench_pool_step.py --shapes 8x1,32x128 --state bf16 --fused --out step.json
    python benchmarks/bench_pool_step.py --forms advance --shapes 8x1,8x8,8x32,8x64 --state bf16
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # this checkout's package first (a worktree may share another's venv)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

STANDARD = "8x1,32x1,8x8,32x8,8x32,32x32,8x128,32x128,8x512,32x512"  # HVxB
FORMS = ("decode+advance", "fused", "advance", "decode")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default=STANDARD, help="comma-separated HVxB (H = HV, K = V = 128)")
    p.add_argument("--state", default="bf16,fp32", help="checkpoint dtypes, comma-separated")
    p.add_argument("--layout", default="predecayed", help="the pool's ring_layout")
    p.add_argument("--ring-length", type=int, default=16, help="L, the ring's entries per slot")
    p.add_argument("--fused", action="store_true", help="the advance fused into the decode (else decode + advance)")
    p.add_argument("--both", action="store_true", help="time both forms")
    p.add_argument("--forms", default=None,
                   help="comma-separated forms to time, from decode+advance, fused, advance (the cursor kernel alone), "
                        "decode (the plain decode alone, every cursor phase); "
                        "replaces --fused and --both")
    p.add_argument("--layers", type=int, default=1, help="layers per model step (decodes before the one advance)")
    p.add_argument("--settle", action="store_true", help="free the previous shape's memory before each shape")
    p.add_argument("--conv", type=int, default=0, help="the pool's conv kernel W (0: none): decodes take pre-conv inputs")
    p.add_argument("--override", type=override_arg, default={},
                   help="DecodePlan fields of the plain decodes' plans, e.g. 'early_qk=false' (plan_args.py)")
    p.add_argument("--fused-override", type=override_arg, default={},
                   help="DecodePlan fields of the fused decode's plan (the step's last with --forms fused)")
    p.add_argument("--reps", type=int, default=30, help="timed rounds over all slot sets")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    p.add_argument("--print-plans", action="store_true",
                   help="print each shape's edited plans (checked) and exit: no GPU needed")
    args = p.parse_args(argv)
    if args.forms:
        args.form_list = tuple(args.forms.split(","))
        unknown = set(args.form_list) - set(FORMS)
        if unknown:
            p.error(f"--forms: unknown form(s) {sorted(unknown)}; expected some of {list(FORMS)}")
    else:
        args.form_list = FORMS[:2] if args.both else (FORMS[1] if args.fused else FORMS[0],)
    return args


def override_arg(text: str) -> dict:
    """``--override``'s type: ``field=value[,...]`` of ``DecodePlan`` (plan_args.override_arg, imported late so
    that ``--help`` needs no package)."""
    from plan_args import override_arg as parse

    return parse(text)


def step_plans(hv: int, batch: int, state: str, layout: str, L: int, conv: int, plain: dict, fused: dict) -> tuple:
    """``(plain decode's plan, fused decode's plan)``: the library's with the fields of ``plain`` / ``fused``
    replaced (plan_args.build_plan, which checks them), None where no field is given (the pool's own choice)."""
    from plan_args import build_plan

    def plan(advance: bool, changes: dict) -> object:
        return build_plan(batch=batch, heads=hv, state=state, layout=layout, ring_length=L, advance=advance,
                          cursor_table=True, conv_kernel_size=conv, override=changes) if changes else None

    return plan(False, plain), plan(True, fused)


def time_shape(hv: int, batch: int, state: str, layout: str, L: int, form: str, reps: int, layers: int = 1,
               conv: int = 0, override: dict | None = None, fused_override: dict | None = None) -> dict:
    import torch

    from tp_replayssm import KDAHeads, ReplaySSMStatePool

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[state]
    dev = torch.device("cuda", torch.cuda.current_device())
    K = V = 128
    state_bytes = hv * V * K * dt.itemsize
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    sets = max(2, min(64, -(-8 * l2 // (layers * batch * state_bytes))))
    heads = KDAHeads(hv, hv, K, V)
    pool = ReplaySSMStatePool(heads, num_layers=layers, num_slots=sets * batch, ring_length=L, state_dtype=dt,
                              ring_layout=layout, device=dev, conv_kernel_size=conv)
    ids = pool.alloc(sets * batch)
    gen = torch.Generator(device=dev).manual_seed(0)
    pool.checkpoint.normal_(0, 0.05, generator=gen)
    width = 2 * hv * K + hv * V
    x = (torch.randn(batch, width, device=dev, generator=gen) * 0.5).bfloat16()
    a = torch.randn(batch, hv * K, device=dev, generator=gen).bfloat16()
    b = torch.randn(batch, hv, device=dev, generator=gen).bfloat16()
    A_log = torch.empty(hv, device=dev).uniform_(-1, 0.5, generator=gen)
    dt_bias = torch.empty(hv * K, device=dev).uniform_(-4, 0, generator=gen)
    out = torch.empty(batch, 1, hv, V, dtype=torch.bfloat16, device=dev)
    conv_args = {}
    if conv:  # depthwise taps and bias over mixed_qkv's columns, bf16 like the activations
        conv_args = dict(conv_weight=(torch.randn(width, conv, device=dev, generator=gen) * 0.3).bfloat16(),
                         conv_bias=(torch.randn(width, device=dev, generator=gen) * 0.1).bfloat16())
    slot_sets = [ids[i * batch:(i + 1) * batch].clone() for i in range(sets)]

    plain_plan, fused_plan = step_plans(hv, batch, state, layout, L, conv, override or {}, fused_override or {})

    def step(slots: torch.Tensor) -> None:
        if form != "advance":
            for layer in range(layers):
                fused = form == "fused" and layer == layers - 1
                pool.decode(layer, x, a, b, A_log, dt_bias, slots, out=out, advance=fused,
                            plan=fused_plan if fused else plain_plan, **conv_args)
        if form in ("decode+advance", "advance"):
            pool.advance(slots)

    if form == "decode":
        phases = [us / layers for us in time_phases(pool, step, slot_sets, ids, L, reps)]
        pool.check()
        us = statistics.fmean(phases)
        return dict(hv=hv, batch=batch, state=state, layout=layout, L=L, form=form, fused=False, sets=sets,
                    layers=layers, conv=conv, us_per_step=us, us_min=min(phases), phase_us=phases)

    def cycles() -> None:  # a full cycle per set
        for s in slot_sets:
            for _ in range(L):
                step(s)

    warm_up(cycles)
    graphs = []
    for s in slot_sets:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(L):
                step(s)
        graphs.append(g)
    times = replay_us(graphs, len(graphs) * L, reps)  # one cycle each: the cursors are back where capture left them
    pool.check()
    per = 1 if form == "advance" else layers  # us per layer step; the cursor kernel alone runs once per model step
    return dict(hv=hv, batch=batch, state=state, layout=layout, L=L, form=form, fused=form == "fused", sets=sets,
                layers=layers, conv=conv, us_per_step=statistics.median(times) / per, us_min=min(times) / per)


def warm_up(run) -> None:
    """``run()`` once on a side stream (compiles, records the direct launches), then synchronize."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def replay_us(graphs: list, steps: int, reps: int) -> list[float]:
    """us per step of ``reps`` rounds, each replaying every graph once (``steps`` steps in all), after one untimed
    round."""
    import torch

    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for g in graphs:
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return times


def time_phases(pool, step, slot_sets: list, ids, L: int, reps: int) -> list[float]:
    """us per step of ``step`` (the plain decode) at each of the L cursor phases: per phase one graph of one step of
    every slot set, its median replay time over ``reps``; the cursors move to the next phase between phases."""
    import torch

    def one_each() -> None:
        for s in slot_sets:
            step(s)

    warm_up(one_each)
    medians = []
    for _ in range(L):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for s in slot_sets:
                step(s)
        medians.append(statistics.median(replay_us([g], len(slot_sets), reps)))
        pool.advance(ids)  # every slot to the next phase (the last phase's decode flushed: back to 0)
        torch.cuda.synchronize()
    return medians


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    import tp_replayssm

    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    for state in args.state.split(","):  # every edited plan checked before any GPU work (plan_args.build_plan)
        for hv, batch in shapes:
            plans = step_plans(hv, batch, state, args.layout, args.ring_length, args.conv, args.override,
                               args.fused_override)
            if args.print_plans:
                print(f"HV{hv} B{batch} {state}: plain {plans[0]}\n  fused {plans[1]}  (None: the pool's own plan)")
    if args.print_plans:
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_pool_step.py times CUDA graphs: it needs a CUDA GPU (--print-plans checks the edited "
                         "plans here; benchmarks/kernel_regs.py --override compiles one for sm_90 on CPU)")

    rows = []
    meta = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), package=tp_replayssm.__file__,
                date=time.strftime("%Y-%m-%d %H:%M:%S"), argv=sys.argv[1:])
    forms = args.form_list
    for state in args.state.split(","):
        for hv, batch in shapes:
            for form in forms:
                if args.settle:
                    gc.collect()
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                t0 = time.time()
                row = time_shape(hv, batch, state, args.layout, args.ring_length, form, args.reps, args.layers,
                                 args.conv, args.override, args.fused_override)
                row.update(override=args.override, fused_override=args.fused_override)
                rows.append(row)
                print(f"HV{hv:<3} B{batch:<4} {state} {args.layout} {form}: "
                      f"{row['us_per_step']:8.2f} us/step (min {row['us_min']:.2f}; {row['sets']} sets; "
                      f"{time.time() - t0:.0f} s)", flush=True)
                if args.out:  # after every shape, so that a run cut by a time limit keeps the shapes it timed
                    with open(args.out, "w") as f:
                        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
