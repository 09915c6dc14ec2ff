#!/usr/bin/env python3
"""What the short convolution adds to one layer's pool decode step on a GPU, graph-captured and cycle-averaged.

Through the pool's public API, as an engine runs one layer (H = HV heads, K = V = 128, bf16 activations, rings and
conv windows, kernel ``W``), per shape:

- ``decode_us``: ``pool.decode`` on post-conv ``mixed_qkv`` + ``pool.advance`` (or, ``--fused``, ``pool.decode(...,
  advance=True)``): each CUDA graph holds one full cursor cycle (L steps, the last one flushes) of one slot set, and
  the replays rotate over enough disjoint slot sets that the state streams from HBM (8x the L2); us/step = median
  replay time / L. Timed before and after the conv steps: the mean, and ``spread_pct`` (their difference, the noise
  the added cost is read against).
- per ``--variant`` (one table row each): ``conv_decode_us``, the same step with ``pool.decode(..., conv_weight=,
  conv_bias=)`` on pre-conv ``mixed_qkv``, and ``added_us``/``added_pct`` relative to ``decode_us``. The variants:
  ``taps`` and ``once``, the conv in a launch of its own in that form (``ConvPlan.form``; ``taps`` is the form
  measured before ``once`` existed), then the decode; ``lib``, the library's plan (the conv fused into the decode
  launch where the plan fuses it, docs/conv.md).
- ``conv_us`` (``taps``/``once`` rows): ``pool.conv_update`` alone in that form, one graph of up to ``--max-calls``
  calls rotating over slot sets of a pool of its own (at most 16384 slots), enough that the windows stream from HBM
  (8x the L2) where those caps allow (``alone_windows_mb``: the windows it cycles through; below the L2's size the
  number is L2-warm); ``floor_us``: the conv's bytes (``tp_replayssm.kernels.conv.conv_bytes``: inputs, outputs,
  window read and written, weights) at the measured copy bandwidth; ``pct_floor = floor / conv_us``; ``host_us``:
  host time of one eager ``conv_update`` call.
- ``target``: ``ok`` where the conv adds at most 5% at ``B >= 32`` and at most 0.5 us at ``B <= 8`` (``MISS``
  otherwise; ``-`` between).

Before timing, each shape's conv runs once per form on its pool against ``tp_replayssm.pool.conv.conv_reference`` on
CPU copies (outputs within bf16 rounding, windows bit for bit), and the ``lib`` step once against the two-launch
step on a twin pool; a failed check prints ``WRONG`` and the script exits 1.

    python benchmarks/bench_conv.py --out conv.json                 # HV 4, 8, 32 x B 1, 8, 32, 128, 512, both states
    python benchmarks/bench_conv.py --shapes 8x8,32x128 --state bf16 --variant taps,once,lib
    python benchmarks/bench_conv.py --shapes 8x8 --state bf16 --variant lib --lib-override value_tile=128  # mode 1
    python benchmarks/bench_conv.py --dry-run                       # shapes, byte floors, launch plans; any machine
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # the package; plan_args
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

STANDARD = ",".join(f"{hv}x{b}" for hv in (4, 8, 32) for b in (1, 8, 32, 128, 512))  # HVxB
TARGET_PCT, TARGET_SMALL_US = 5.0, 0.5  # the conv may add this much at B >= 32, resp. B <= 8
VARIANTS = ("taps", "once", "lib", "fused")  # the conv in a launch of its own in each form; the library's plan; the
# conv fused into the decode launch (plan_decode(..., fuse_conv=True))
MAX_ALONE_SLOTS = 16384  # slots of the conv-alone pool, at most
K = V = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default=STANDARD, help="comma-separated HVxB (H = HV, K = V = 128)")
    p.add_argument("--state", default="fp32,bf16", help="checkpoint dtypes, comma-separated")
    p.add_argument("--layout", default="predecayed", help="the pool's ring_layout")
    p.add_argument("--ring-length", type=int, default=16)
    p.add_argument("--conv-size", type=int, default=4, help="the conv kernel W")
    p.add_argument("--no-bias", action="store_true", help="a conv without bias")
    p.add_argument("--fused", action="store_true", help="the advance fused into the decode (else decode + advance)")
    p.add_argument("--variant", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--lib-override", default="", help="DecodePlan fields of the lib variant's plan, e.g. "
                                                      "'value_tile=128' (benchmarks/plan_args.py --override)")
    p.add_argument("--reps", type=int, default=30, help="timed rounds over all slot sets")
    p.add_argument("--max-calls", type=int, default=8192, help="conv_update calls in the conv-alone graph, at most")
    p.add_argument("--copy-mb", type=int, default=1024, help="size of the bandwidth copy")
    p.add_argument("--budget-s", type=float, default=480.0, help="start no shape after this many seconds")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    p.add_argument("--dry-run", action="store_true", help="shapes, byte floors and launch plans; no GPU needed")
    p.add_argument("--assume-bw", type=float, default=4300.0, help="copy bandwidth (GB/s) for --dry-run floors")
    args = p.parse_args(argv)
    if args.conv_size < 1:
        p.error("--conv-size must be >= 1")
    args.variants = [v for v in args.variant.split(",") if v]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        p.error(f"--variant takes a comma-separated list of {', '.join(VARIANTS)}; got {args.variant!r}")
    return args


def shapes_of(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    return [(int(hv), int(b), state) for state in args.state.split(",")
            for hv, b in (s.split("x") for s in args.shapes.split(","))]


def floors(hv: int, batch: int, W: int, bias: bool, bw_gbps: float) -> dict[str, float]:
    from tp_replayssm.kernels.conv import conv_bytes

    nbytes = conv_bytes(batch, 2 * hv * K + hv * V, W, bias=bias)
    return {"conv_bytes": nbytes, "floor_us": nbytes / (bw_gbps * 1e3)}


def copy_bandwidth(device: object, mb: int) -> float:
    """GB/s of a device-to-device copy (bytes read + written), median of 20."""
    import torch

    src = torch.empty(mb * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return 2 * src.numel() / (statistics.median(times) * 1e-3) / 1e9


def capture(calls: list, stream: object) -> object:
    """One CUDA graph of ``calls`` (run once first on ``stream``: compiles and records the direct launches)."""
    import torch

    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g


def time_graphs(graphs: list, steps_per_graph: int, reps: int) -> float:
    """Median us per step over ``reps`` rounds that replay every graph once (bench_pool_step.replay_us)."""
    from bench_pool_step import replay_us

    return statistics.median(replay_us(graphs, len(graphs) * steps_per_graph, reps))


def check_conv(pool: object, x: object, weight: object, bias: object, slots: object, plan: object = None) -> dict:
    """One ``conv_update`` (``plan``: a ``ConvPlan``, else the library's) against ``conv_reference`` on CPU copies of
    the windows."""
    import torch

    from tp_replayssm.pool.conv import conv_reference

    idx = slots.long()
    window = pool.conv_state[0, idx].cpu()
    y = pool.conv_update(0, x, weight, slots, bias=bias, **({} if plan is None else {"plan": plan}))
    y_ref, win_ref = conv_reference(x.cpu()[:, None], window, weight.cpu(), None if bias is None else bias.cpu(),
                                    "silu")
    err = float((y.cpu().double() - y_ref[:, 0].double()).norm() / y_ref.double().norm().clamp_min(1e-30))
    windows_ok = torch.equal(pool.conv_state[0, idx].cpu(), win_ref.to(pool.conv_dtype))
    ok = err <= 1e-2 and windows_ok
    pool.check()
    return {"conv_err": err, "check": "ok" if ok else "WRONG"}


def conv_plans(batch: int, D: int, W: int, sms: int) -> dict[str, object]:
    """The conv launch plan of each two-launch variant: the library's plan of that form."""
    from tp_replayssm.kernels.conv_plan import plan_conv

    return {"taps": plan_conv(batch, D, W, sms), "once": plan_conv(batch, D, W, sms, 1)}


def two_launch_plan(hv: int, batch: int, state: str, args: argparse.Namespace) -> object:
    """The decode plan of the two-launch variants: the library's plan of the step with its conv not fused (None where
    the library's plan never fuses)."""
    import dataclasses

    from tp_replayssm.kernels.plan import DecodePlan

    if "fused_conv" not in {f.name for f in dataclasses.fields(DecodePlan)}:
        return None
    from plan_args import build_plan

    return build_plan(batch=batch, heads=hv, state=state, layout=args.layout, ring_length=args.ring_length,
                      advance=args.fused, cursor_table=True, conv_kernel_size=args.conv_size,
                      override={"fused_conv": 0})


def library_plan(hv: int, batch: int, state: str, args: argparse.Namespace,
                 fuse_conv: bool | None = None) -> object:
    """The decode plan of the ``lib`` variant: the library's for the step with the conv (its ``fused_conv``: 0 for two
    launches), with ``--lib-override`` applied; with ``fuse_conv=True`` the ``fused`` variant's."""
    from plan_args import build_plan

    return build_plan(batch=batch, heads=hv, state=state, layout=args.layout, ring_length=args.ring_length,
                      advance=args.fused, cursor_table=True, conv_kernel_size=args.conv_size,
                      override=args.lib_override, fuse_conv=fuse_conv)


def library_fused_conv(hv: int, batch: int, state: str, args: argparse.Namespace) -> int:
    """The library's decode plan's ``fused_conv`` for the step with the conv (0: two launches)."""
    return library_plan(hv, batch, state, args).fused_conv


def time_shape(hv: int, batch: int, state: str, args: argparse.Namespace, l2: int, bw: float) -> list[dict]:
    """The rows of one shape: one per variant (module docstring)."""
    import torch

    from tp_replayssm import KDAHeads, ReplaySSMStatePool

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[state]
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    L, W, fused = args.ring_length, args.conv_size, args.fused
    D = 2 * hv * K + hv * V
    state_bytes = hv * V * K * dt.itemsize
    sets = max(2, min(64, -(-8 * l2 // (batch * state_bytes))))
    heads = KDAHeads(hv, hv, K, V)
    kw = dict(num_layers=1, ring_length=L, state_dtype=dt, ring_layout=args.layout, device=dev, conv_kernel_size=W)
    pool = ReplaySSMStatePool(heads, num_slots=sets * batch, **kw)
    ids = pool.alloc(sets * batch)
    gen = torch.Generator(device=dev).manual_seed(0)
    pool.checkpoint.normal_(0, 0.05, generator=gen)
    pool.conv_state.normal_(0, 0.5, generator=gen)
    x = (torch.randn(batch, D, device=dev, generator=gen) * 0.5).bfloat16()
    a = torch.randn(batch, hv * K, device=dev, generator=gen).bfloat16()
    b = torch.randn(batch, hv, device=dev, generator=gen).bfloat16()
    A_log = torch.empty(hv, device=dev).uniform_(-1, 0.5, generator=gen)
    dt_bias = torch.empty(hv * K, device=dev).uniform_(-4, 0, generator=gen)
    weight = (torch.randn(D, W, device=dev, generator=gen) * W ** -0.5).bfloat16()
    bias = None if args.no_bias else (torch.randn(D, device=dev, generator=gen) * 0.1).bfloat16()
    out = torch.empty(batch, 1, hv, V, dtype=torch.bfloat16, device=dev)
    slot_sets = [ids[i * batch:(i + 1) * batch].clone() for i in range(sets)]
    plans = conv_plans(batch, D, W, sms)
    two_launch = two_launch_plan(hv, batch, state, args)
    lib = library_plan(hv, batch, state, args) if args.lib_override else None  # None: the pool's own choice
    fused_plan = library_plan(hv, batch, state, args, fuse_conv=True)
    shape = dict(hv=hv, batch=batch, state=state, layout=args.layout, L=L, W=W, D=D, fused=fused, sets=sets,
                 **floors(hv, batch, W, bias is not None, bw))
    checks = {form: check_conv(pool, x, weight, bias, slot_sets[0], plans[form]) for form in ("taps", "once")}
    if "lib" in args.variants:  # the library's step against the two-launch step, on a twin pool
        checks["lib"] = check_step(pool, kw, heads, x, a, b, A_log, dt_bias, weight, bias, slot_sets[0], lib,
                                   two_launch, fused)
    if "fused" in args.variants:
        checks["fused"] = check_step(pool, kw, heads, x, a, b, A_log, dt_bias, weight, bias, slot_sets[0],
                                     fused_plan, two_launch, fused)

    def step(slots: torch.Tensor, variant: str | None) -> None:
        conv = {} if variant is None else dict(conv_weight=weight, conv_bias=bias)
        if variant in ("taps", "once"):
            conv.update(plan=two_launch, conv_plan=plans[variant])
        elif variant == "lib" and lib is not None:
            conv.update(plan=lib)
        elif variant == "fused":
            conv.update(plan=fused_plan)
        pool.decode(0, x, a, b, A_log, dt_bias, slots, out=out, advance=fused, **conv)
        if not fused:
            pool.advance(slots)

    stream = torch.cuda.Stream()
    plain = [capture([lambda s=s: step(s, None)] * L, stream) for s in slot_sets]
    graphs = {v: [capture([lambda s=s, v=v: step(s, v)] * L, stream) for s in slot_sets] for v in args.variants}
    d1 = time_graphs(plain, L, args.reps)
    with_conv = {v: time_graphs(g, L, args.reps) for v, g in graphs.items()}
    d2 = time_graphs(plain, L, args.reps)
    shape["decode_us"] = (d1 + d2) / 2
    shape["spread_pct"] = 100.0 * abs(d1 - d2) / shape["decode_us"]
    pool.check()
    del plain, graphs, pool

    rows = []
    for v in args.variants:
        fuse = True if v == "fused" else None
        plan = plans[v] if v in plans else library_plan(hv, batch, state, args, fuse_conv=fuse)
        row = dict(shape, variant=v, plan=str(plan), **checks.get(v, checks["once"]))
        row["conv_decode_us"] = with_conv[v]
        row["added_us"] = row["conv_decode_us"] - row["decode_us"]
        row["added_pct"] = 100.0 * row["added_us"] / row["decode_us"]
        if batch >= 32:
            row["target"] = "ok" if row["added_pct"] <= TARGET_PCT else "MISS"
        elif batch <= 8:
            row["target"] = "ok" if row["added_us"] <= TARGET_SMALL_US else "MISS"
        else:
            row["target"] = "-"
        if v in plans:
            row.update(time_alone(heads, kw, batch, x, weight, bias, plans[v], row["conv_bytes"], row["floor_us"],
                                  l2, args, stream, gen))
        rows.append(row)
    torch.cuda.empty_cache()
    return rows


def check_step(pool: object, kw: dict, heads: object, x: object, a: object, b: object, A_log: object,
               dt_bias: object, weight: object, bias: object, slots: object, lib: object, two_launch: object,
               fused: bool) -> dict:
    """One step of the ``lib`` plan (None: the library's) on ``pool`` and of the two-launch plan on a twin with the
    same state: outputs within bf16 rounding, windows bit for bit (then the pool's state is as before)."""
    import torch

    from tp_replayssm import ReplaySSMStatePool

    twin = ReplaySSMStatePool(heads, num_slots=pool.num_slots, **kw)
    twin.alloc(pool.num_slots)
    names = ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors", "conv_state")
    saved = {n: getattr(pool, n).clone() for n in names}
    for n in names:
        getattr(twin, n).copy_(saved[n])
    y = pool.decode(0, x, a, b, A_log, dt_bias, slots, advance=fused, conv_weight=weight, conv_bias=bias, plan=lib)
    want = twin.decode(0, x, a, b, A_log, dt_bias, slots, advance=fused, conv_weight=weight, conv_bias=bias,
                       plan=two_launch, conv_plan=conv_plans(slots.shape[0], pool.conv_channels,
                                                             pool.conv_kernel_size, 132)["once"])
    err = float((y.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    ok = err <= 1e-2 and torch.equal(pool.conv_state, twin.conv_state)
    pool.check()
    for n in names:
        getattr(pool, n).copy_(saved[n])
    return {"conv_err": err, "check": "ok" if ok else "WRONG"}


def time_alone(heads: object, kw: dict, batch: int, x: object, weight: object, bias: object, plan: object,
               per_call: int, floor_us: float, l2: int, args: argparse.Namespace, stream: object,
               gen: object) -> dict:
    """``pool.conv_update`` alone with ``plan`` on a pool of its own whose windows stream from HBM."""
    import torch

    from tp_replayssm import ReplaySSMStatePool

    calls = max(2, min(args.max_calls, -(-8 * l2 // per_call)))
    conv_sets = max(1, min(calls, MAX_ALONE_SLOTS // batch))
    alone = ReplaySSMStatePool(heads, num_slots=conv_sets * batch, **{**kw, "state_dtype": torch.bfloat16})
    aids = alone.alloc(conv_sets * batch)
    alone.conv_state.normal_(0, 0.5, generator=gen)
    asets = [aids[i * batch:(i + 1) * batch].clone() for i in range(conv_sets)]
    g = capture([lambda i=i: alone.conv_update(0, x, weight, asets[i % conv_sets], bias=bias, plan=plan)
                 for i in range(calls)], stream)
    res = dict(conv_us=time_graphs([g], calls, args.reps), conv_calls=calls, conv_sets=conv_sets,
               alone_windows_mb=conv_sets * batch * x.shape[1] * (args.conv_size - 1) * 2 / 2**20)
    res["pct_floor"] = 100.0 * floor_us / res["conv_us"]
    host = []
    for i in range(50):
        t0 = time.perf_counter()
        alone.conv_update(0, x, weight, asets[i % conv_sets], bias=bias, plan=plan)
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    res["host_us"] = statistics.median(host[10:]) * 1e6
    alone.check()
    del g, alone
    return res


COLUMNS = ("shape", "variant", "decode_us", "conv_decode_us", "added_us", "added_pct", "spread_pct", "conv_us",
           "floor_us", "pct_floor", "alone_windows_mb", "host_us", "target", "check")


def table(rows: list[dict]) -> list[str]:
    def cell(r: dict, c: str) -> str:
        if c == "shape":
            return f"HV{r['hv']} B{r['batch']} {r['state']}"
        v = r.get(c, "-")
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    cells = [[cell(r, c) for c in COLUMNS] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(COLUMNS)]
    return ["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths))] + \
        ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    shapes = shapes_of(args)
    if args.dry_run:
        from tp_replayssm.kernels.conv_plan import plan_conv

        print(f"{len(shapes)} shapes, W={args.conv_size}; conv byte floors at {args.assume_bw:.0f} GB/s; variants "
              f"{','.join(args.variants)}")
        for hv, batch, state in shapes:
            f = floors(hv, batch, args.conv_size, not args.no_bias, args.assume_bw)
            D = 2 * hv * K + hv * V
            taps = plan_conv(batch, D, args.conv_size, 132)
            lib = two_launch_plan(hv, batch, state, args)
            fused = "" if lib is None else f"; decode plan fused_conv={library_fused_conv(hv, batch, state, args)}"
            print(f"  HV{hv:<3} B{batch:<4} {state}: D={D:6d}, {f['conv_bytes'] / 2**20:8.3f} MiB = "
                  f"{f['floor_us']:7.2f} us; {plan_conv(batch, D, args.conv_size, 132, 1)}; taps: {taps.block_d} "
                  f"channels x {taps.num_warps} warps{fused}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("bench_conv: no CUDA device is visible; --dry-run prints the shapes and floors here")
        return 2
    import tp_replayssm

    dev = torch.device("cuda", torch.cuda.current_device())
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    bw = copy_bandwidth(dev, args.copy_mb)
    meta = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), package=tp_replayssm.__file__,
                date=time.strftime("%Y-%m-%d %H:%M:%S"), argv=sys.argv[1:], copy_gbps=bw, l2_bytes=l2)
    print(f"bench_conv: {meta['gpu']}, copy {bw:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB; {len(shapes)} shapes, "
          f"W={args.conv_size}, {'fused advance' if args.fused else 'decode + advance'}", flush=True)
    rows, t_start = [], time.time()
    for hv, batch, state in shapes:
        if time.time() - t_start > args.budget_s:
            print(f"HV{hv} B{batch} {state}: skipped (budget {args.budget_s:.0f} s)", flush=True)
            continue
        t0 = time.time()
        try:
            new_rows = time_shape(hv, batch, state, args, l2, bw)
        except Exception as exc:  # record it and go on
            new_rows = [dict(hv=hv, batch=batch, state=state, error=f"{type(exc).__name__}: {exc}"[:300])]
        rows.extend(new_rows)
        for row in new_rows:
            print(f"HV{hv:<3} B{batch:<4} {state} {row.get('variant', '-'):4}: decode "
                  f"{row.get('decode_us', float('nan')):8.2f} us, with conv {row.get('conv_decode_us', float('nan')):8.2f}"
                  f" us (+{row.get('added_us', float('nan')):.2f} us, {row.get('added_pct', float('nan')):+.1f}%), conv "
                  f"alone {row.get('conv_us', float('nan')):.2f} us (floor {row.get('floor_us', float('nan')):.2f}), "
                  f"{row.get('check', row.get('error'))} ({time.time() - t0:.0f} s)", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\n== us per step; added = (decode with the conv) - (decode); target +{TARGET_PCT:g}% at B >= 32, "
          f"+{TARGET_SMALL_US} us at B <= 8")
    for line in table([r for r in rows if "error" not in r]):
        print(line)
    for r in rows:
        if "error" in r:
            print(f"HV{r['hv']} B{r['batch']} {r['state']}: ERROR {r['error']}")
    bad = [r for r in rows if r.get("check") == "WRONG" or "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
