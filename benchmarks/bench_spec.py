#!/usr/bin/env python3
"""Speculative decoding on one GPU: ``T`` draft tokens verified and committed against plain decode steps,
graph-captured and averaged over every cursor phase.

What it measures, per shape (one layer, or a model step of ``--layers N``; K = V = 128, L = 16, bf16 rings and
activations, the pool's default layout):

- ``verify_us``: ``pool.verify`` of ``T`` drafts per row, then ``pool.commit`` (a chain; every row accepts
  ``--accept`` drafts each step, so the committed cursors walk ``c -> (0 if c + T > L-1 else c) + accept`` and the
  drafts fold every few steps). ONE CUDA graph holds one step for each of ``n_sets`` disjoint slot sets (enough sets
  that a replay touches 4x the L2, at most ``--max-graph-steps`` steps); the pool's state evolves on the device from
  replay to replay, so timing many replays averages over the cursor cycle (rows start at staggered cursors).
  us/step = median replay time / n_sets.
- ``decode_us``: one decode step of the same rows with the cursor advance fused in (``pool.decode(...,
  advance=True)``, the library's step), timed the same way (its cursors walk the full cycle of ``L`` phases);
  ``decode_sep_us`` with the separate advance kernel.
- ``--layers N`` (default 1): each step is a model step of ``N`` layers, as an engine runs it: ``N`` verifies then
  ONE commit (it moves every layer's state), against ``N`` decodes with the advance fused into the last one (the
  plain decodes before it); ``verify_us`` and ``decode_us`` are then per layer step (the model step's time / ``N``).
  One layer charges a whole commit to one verify and the fused advance to every decode.
- ``x1 = verify_us / decode_us`` (targets: <= 1.6 at B >= 32, <= 2.0 at B <= 8) and ``xT = verify_us / (T *
  decode_us)``: the verify step against the ``T`` decode steps it replaces.
- ``floor_us``: the bytes a verify + commit step must move (:func:`verify_bytes`: the checkpoint read once, the
  committed ring entries read, ``T`` ring entries written, the fold's checkpoint write at its share of the cycle,
  inputs and outputs) over the copy bandwidth measured in the same run; ``%floor = floor_us / verify_us``.
- Before timing, each shape checks one verify + commit against the PyTorch reference on a CPU copy of the pool.
- ``--override field=value,...`` (repeatable): each shape is also timed with the library's verify plan with those
  ``VerifyPlan`` fields replaced (``value_tile`` brings its ``tile_readers``), e.g. ``value_chunk=32`` or
  ``operand_parts=2``; the table's last column names the override.
- ``--forms fla``: FLA's speculative-decoding verify in place of ours (vLLM's scheme for KDA, one state block
  written per draft, the commit free: ``benchmarks/fla_spec.py``), its outputs checked against the pool's verify of
  the same drafts first.

Commands (the H200; ``source benchmarks/device_setup.sh`` first)::

    python3 benchmarks/bench_spec.py                   # B in 1,8,32,128 x HV in 8,32 x fp32,bf16 state (T = 4)
    python3 benchmarks/bench_spec.py --quick           # 4 shapes
    python3 benchmarks/bench_spec.py --dry-run         # shapes, plans and byte floors; any machine

Writes ``bench_spec.json`` into ``--out`` (else ``$OUT``, else ``benchmarks/out/``) after every shape and prints the
table last.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

from plan_args import replace_verify, verify_override_arg  # noqa: E402

log = logging.getLogger("bench_spec")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cycle(L: int, T: int, accept: int) -> list[tuple[int, bool]]:
    """The committed cursors ``(c, folds)`` a row takes, step after step, once it is on its cycle."""
    c, seen, order = 0, {}, []
    while c not in seen:
        seen[c] = len(order)
        fold = c + T > L - 1
        order.append((c, fold))
        c = (0 if fold else c) + accept
    return order[seen[c]:]


def verify_bytes(B: int, HV: int, H: int, K: int, V: int, L: int, T: int, accept: int, state_bytes: int,
                 cache_bytes: int = 2, act_bytes: int = 2, predecayed: bool = True) -> dict[str, float]:
    """The fewest bytes one verify + commit step moves, averaged over the cursor cycle of ``accept`` drafts a step:
    the checkpoint read once; the committed ring entries read (deltas, keys, and the last cumulative gate, or every
    gate in the sglang layout); ``T`` draft entries written; the fold's checkpoint write at its share of the cycle;
    inputs, outputs, parameters; the commit's cursor (chain: nothing else)."""
    KH = HV if predecayed else H
    steps = cycle(L, T, accept)
    mean_c = statistics.mean(c for c, _ in steps)
    folds = sum(1 for _, f in steps if f) / len(steps)
    entry = HV * V * cache_bytes + KH * K * cache_bytes + HV * K * 4
    ckpt = B * HV * V * K * state_bytes
    ring_read = B * mean_c * (HV * V * cache_bytes + KH * K * cache_bytes) + B * HV * K * 4 * (1 if predecayed
                                                                                                 else mean_c)
    ring_write = B * T * entry
    D = 2 * H * K + HV * V
    io = B * T * (D + HV * K + HV + HV * V) * act_bytes + HV * (K + 1) * 4 + B * 4 * 4
    total = ckpt + ring_read + ring_write + folds * ckpt + io
    return {"bytes": total, "checkpoint_read": ckpt, "fold_write": folds * ckpt, "ring_read": ring_read,
            "ring_write": ring_write, "io": io, "mean_cursor": mean_c, "fold_share": folds}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", default="1,8,32,128")
    p.add_argument("--heads", default="8,32", help="HV list (H = HV)")
    p.add_argument("--state", default="fp32,bf16")
    p.add_argument("--drafts", type=int, default=4, help="T")
    p.add_argument("--accept", type=int, default=3, help="drafts every row accepts per step")
    p.add_argument("--ring", type=int, default=16)
    p.add_argument("--layout", default="predecayed", choices=["predecayed", "sglang"])
    p.add_argument("--lower-bound", type=float, default=None, help="gate lower bound (default: softplus gate)")
    p.add_argument("--quick", action="store_true", help="B in 1,32 x HV 32 x both states")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--footprint-mb", type=float, default=0.0, help="bytes one replay touches (0: 4x the L2)")
    p.add_argument("--max-graph-steps", type=int, default=128)
    p.add_argument("--layers", type=int, default=1,
                   help="layers of a model step: N verifies then one commit, against N decodes (the last with the "
                        "fused advance); times per layer step")
    p.add_argument("--rep-ms", type=float, default=300.0)
    p.add_argument("--out", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--forms", default="tensor-cores",
                   help="verify kernel forms to time, comma-separated: tensor-cores, cuda-cores, fla (FLA's "
                        "spec decoding, vLLM's scheme: benchmarks/fla_spec.py)")
    p.add_argument("--override", action="append", default=[], type=verify_override_arg, metavar="FIELD=VALUE,...",
                   help="(repeatable) also time each shape with the library's verify plan with these VerifyPlan "
                        "fields replaced, e.g. value_chunk=32,num_warps=8 or operand_parts=2")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.heads = "1,32", "32"
    if not 1 <= args.accept <= args.drafts < args.ring:
        p.error("need 1 <= --accept <= --drafts < --ring")
    if args.layers < 1:
        p.error(f"--layers must be >= 1; got {args.layers}")
    if args.layers > 1 and "fla" in args.forms.split(","):
        p.error("--forms fla times one layer (benchmarks/fla_spec.py); run it without --layers")
    return args


def shapes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (form, state, HV, B, plan override) to time: the library's plan first, then each ``--override`` (not
    for the ``fla`` form, which has no plan)."""
    for f in args.forms.split(","):
        form_flag(f)
    return [dict(B=int(b), HV=int(h), state=s, form=f, override=o) for f in args.forms.split(",")
            for s in args.state.split(",") for h in args.heads.split(",") for b in args.batch.split(",")
            for o in ([{}] if f == "fla" else [{}, *args.override])]


def form_flag(form: str) -> bool | None:
    """``tensor_cores`` of ``plan_verify`` for a ``--forms`` entry."""
    if form not in ("tensor-cores", "cuda-cores", "fla"):
        raise SystemExit(f"--forms: unknown form {form!r} (tensor-cores, cuda-cores, fla)")
    return form == "tensor-cores"


def make_pool(shape: dict[str, Any], args: argparse.Namespace, n_sets: int, device: str) -> tuple[Any, list]:
    """A pool of ``args.layers`` layers and ``n_sets * B`` allocated slots with random checkpoints and full random
    rings, the rows' cursors staggered over ``0 .. L-1``; the slot sets."""
    from tp_replayssm import KDAHeads, ReplaySSMStatePool
    from tp_replayssm.reference import predecay_rings

    B, HV, L = shape["B"], shape["HV"], args.ring
    heads = KDAHeads(HV, HV, 128, 128)
    pool = ReplaySSMStatePool(heads, num_layers=args.layers, num_slots=n_sets * B, ring_length=L,
                              state_dtype=DTYPES[shape["state"]], ring_layout=args.layout, device=device)
    ids = pool.alloc(n_sets * B)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    S = pool.num_slots
    pool.checkpoint.copy_(0.05 * torch.randn(pool.checkpoint.shape, device=device, generator=gen))
    pool.d_cache.copy_(0.5 * torch.randn(pool.d_cache.shape, device=device, generator=gen))
    k = torch.randn(pool.k_cache.shape, device=device, generator=gen)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = -0.01 - 0.2 * torch.rand(pool.g_cache.shape, device=device, generator=gen)
    if pool.predecayed:
        k, g = (torch.stack(t) for t in zip(*(predecay_rings(k[i], g[i]) for i in range(pool.num_layers))))
    pool.k_cache.copy_(k)
    pool.g_cache.copy_(g)
    pool.cursors[:S].copy_(torch.arange(S, device=device, dtype=torch.int32) % L)
    perm = torch.randperm(S, device=device, generator=gen).to(torch.int32)
    return pool, [ids[perm[i * B:(i + 1) * B].long()].contiguous() for i in range(n_sets)]


def graph_us(step_fns: list, rep_ms: float, reps_multiple: int) -> float:
    """Capture all steps in one graph (after an eager warm-up on a side stream); median us per step over replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in step_fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in step_fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    reps = max(reps_multiple, int(rep_ms * 1e-3 / est) // reps_multiple * reps_multiple)
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in evs:
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.mean(s.elapsed_time(e) for s, e in evs) * 1e3 / len(step_fns)


def kernel_times(step_fns: list) -> dict[str, float]:
    """Mean GPU time per step of each kernel the steps launch (eager, under ``torch.profiler``): where a step's time
    goes (the verify kernel, the commit kernels, copies)."""
    from torch.profiler import ProfilerActivity, profile

    for fn in step_fns:  # compiled and warm
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for fn in step_fns:
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if t and ev.key and not ev.key.startswith(("ProfilerStep", "cudaDevice", "cudaStream")):
            times[ev.key[:60]] = round(t / len(step_fns), 3)
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:8])


def model_step(pool: Any, layers: int, slots: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               params: Any, lower_bound: float | None, *, accepted: torch.Tensor | None = None,
               plan: Any = None, fused: bool = True) -> list[torch.Tensor]:
    """One model step of ``layers`` layers on ``pool``, as an engine runs it; the layers' outputs. With ``accepted``
    ``[B]`` int32: a verify of the drafts ``x [B, T, D]`` (``a``, ``b`` likewise) in every layer (``plan``: the verify
    plan), then ONE commit. Without: a decode of ``x [B, D]`` in every layer, the cursor advance fused into the last
    (``fused``) or the separate advance after it."""
    outs = []
    for layer in range(layers):
        if accepted is not None:
            outs.append(pool.verify(layer, x, a, b, params.A_log, params.dt_bias, slots, lower_bound=lower_bound,
                                    plan=plan))
        else:
            outs.append(pool.decode(layer, x, a, b, params.A_log, params.dt_bias, slots, lower_bound=lower_bound,
                                    advance=fused and layer == layers - 1))
    if accepted is not None:
        pool.commit(slots, accepted)
    elif not fused:
        pool.advance(slots)
    return outs


def check_shape(pool: Any, sets: list, args: argparse.Namespace, params: Any, inputs: dict, plan: Any) -> float:
    """One verify + commit model step on the GPU pool against the PyTorch reference on a CPU copy; the outputs' rel.
    error (the largest over the layers)."""
    from tp_replayssm import ReplaySSMStatePool

    ref = ReplaySSMStatePool(pool.heads, num_layers=pool.num_layers, num_slots=pool.num_slots,
                             ring_length=pool.ring_length,
                             state_dtype=pool.state_dtype, ring_layout=pool.ring_layout, device="cpu")
    for name in ("checkpoint", "d_cache", "k_cache", "g_cache", "cursors"):
        getattr(ref, name).copy_(getattr(pool, name))
    ref._slots = copy.deepcopy(pool._slots)
    slots = sets[0]
    x, a, b = (inputs[n][0] for n in ("x", "a", "b"))
    n = torch.full_like(slots, args.accept)
    outs = model_step(pool, pool.num_layers, slots, x, a, b, params, args.lower_bound, accepted=n, plan=plan)
    cpu_params = type(params)(params.A_log.cpu(), params.dt_bias.cpu())
    wants = model_step(ref, ref.num_layers, slots.cpu(), x.cpu(), a.cpu(), b.cpu(), cpu_params, args.lower_bound,
                       accepted=n.cpu())
    pool.check()
    err = max(float((out.float().cpu() - want.float()).norm() / want.float().norm()) for out, want in zip(outs, wants))
    if not torch.equal(pool.cursors.cpu(), ref.cursors):
        raise RuntimeError("commit: cursors differ from the reference")
    return err


_DECODE_US: dict[tuple[int, int, str], tuple[float, float]] = {}


def run_shape(shape: dict[str, Any], args: argparse.Namespace, l2: int, gbps: float) -> dict[str, Any]:
    from tp_replayssm.testing import random_head_params

    B, HV, T, L = shape["B"], shape["HV"], args.drafts, args.ring
    sb = DTYPES[shape["state"]].itemsize
    model = verify_bytes(B, HV, HV, 128, 128, L, T, args.accept, sb, predecayed=args.layout == "predecayed")
    per_set = (B * HV * 128 * 128 * sb + B * HV * L * (128 * 2 * 2 + 128 * 4)) * args.layers
    target = args.footprint_mb * 2**20 if args.footprint_mb > 0 else 4 * l2
    n_sets = int(max(1, min(math.ceil(target / per_set), args.max_graph_steps)))
    rec: dict[str, Any] = {**shape, "T": T, "L": L, "accept": args.accept, "layers": args.layers, "n_sets": n_sets,
                           **model}
    pool, sets = make_pool(shape, args, n_sets, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(args.seed + 1)
    params = random_head_params(HV, 128, device="cuda")
    D = 3 * HV * 128
    n_in = min(n_sets, 16)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    inputs = {"x": [mk(B, T, D) for _ in range(n_in)], "a": [mk(B, T, HV * 128) for _ in range(n_in)],
              "b": [mk(B, T, HV) for _ in range(n_in)], "x1": [mk(B, D) for _ in range(n_in)],
              "a1": [mk(B, HV * 128) for _ in range(n_in)], "b1": [mk(B, HV) for _ in range(n_in)]}
    lb = args.lower_bound
    period = len(cycle(L, T, args.accept))
    if shape["form"] == "fla":
        import fla_spec

        fla_spec.time_row(rec, pool, sets, inputs, params, lb, args.accept, DTYPES[shape["state"]], period,
                          kernel_times, graph_us, args.rep_ms, args.seed + 2)
        return decode_and_ratios(rec, pool, sets, inputs, params, args, shape, n_sets, model, gbps)
    from tp_replayssm.kernels.verify_plan import VerifyProblem, plan_verify

    plan = plan_verify(VerifyProblem(B, T, HV, HV, 128, 128, L, DTYPES[shape["state"]], torch.bfloat16, "cuda",
                                     torch.cuda.get_device_properties(0).multi_processor_count, args.layout, False,
                                     True, lb is not None, lb is not None and (L - 1) * abs(lb) <= 75, torch.bfloat16),
                       tensor_cores=form_flag(shape["form"]))
    if shape["override"]:
        plan = replace_verify(plan, shape["override"], 128)
    rec["plan"] = str(plan)
    rec["check_rel_err"] = check_shape(pool, sets, args, params, inputs, plan)
    accepted = torch.full((B,), args.accept, dtype=torch.int32, device="cuda")

    def verify_step(i: int):  # noqa: ANN202
        def fn() -> None:
            j = i % n_in
            model_step(pool, args.layers, sets[i], inputs["x"][j], inputs["a"][j], inputs["b"][j], params, lb,
                       accepted=accepted, plan=plan)
        return fn

    rec["kernel_us"] = kernel_times([verify_step(i) for i in range(min(n_sets, 2 * period))])
    rec["verify_us"] = graph_us([verify_step(i) for i in range(n_sets)], args.rep_ms, period) / args.layers
    return decode_and_ratios(rec, pool, sets, inputs, params, args, shape, n_sets, model, gbps)


def decode_and_ratios(rec: dict[str, Any], pool: Any, sets: list, inputs: dict, params: Any,
                      args: argparse.Namespace, shape: dict[str, Any], n_sets: int, model: dict[str, float],
                      gbps: float) -> dict[str, Any]:
    """The row's decode step (timed once per shape) and its ratios; frees the pool."""
    B, HV, T, L = shape["B"], shape["HV"], args.drafts, args.ring
    n_in = len(inputs["x1"])

    def decode_step(i: int, fused: bool):  # noqa: ANN202
        def fn() -> None:
            j = i % n_in
            model_step(pool, args.layers, sets[i], inputs["x1"][j], inputs["a1"][j], inputs["b1"][j], params,
                       args.lower_bound, fused=fused)
        return fn

    key = (B, HV, shape["state"])  # the decode step is the same for every verify form: timed once per shape
    if key not in _DECODE_US:
        _DECODE_US[key] = (graph_us([decode_step(i, True) for i in range(n_sets)], args.rep_ms, L) / args.layers,
                           graph_us([decode_step(i, False) for i in range(n_sets)], args.rep_ms, L) / args.layers)
    rec["decode_us"], rec["decode_sep_us"] = _DECODE_US[key]
    rec["x1"] = rec["verify_us"] / rec["decode_us"]
    rec["xT"] = rec["verify_us"] / (T * rec["decode_us"])
    rec["floor_us"] = model["bytes"] / (gbps * 1e3)
    rec["pct_floor"] = 100.0 * rec["floor_us"] / rec["verify_us"]
    del pool, sets, inputs
    torch.cuda.empty_cache()
    return rec


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = (f"{'form':>12} {'HV':>3} {'B':>4} {'state':>5} {'verify+commit':>13} {'decode':>7} {'x1':>5} "
            f"{'target':>6} {'xT':>5} {'floor':>7} {'%floor':>6} {'err':>8} plan override")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r.get('form', ''):>12} {r['HV']:>3} {r['B']:>4} {r['state']:>5} FAILED: {r['error']}")
            continue
        target = 1.6 if r["B"] >= 32 else 2.0
        ok = "ok" if r["x1"] <= target else "MISS"
        lines.append(f"{r.get('form', ''):>12} {r['HV']:>3} {r['B']:>4} {r['state']:>5} {r['verify_us']:>10.2f} us "
                     f"{r['decode_us']:>7.2f} "
                     f"{r['x1']:>5.2f} {'<=' + str(target):>6}{ok:>5} {r['xT']:>5.2f} {r['floor_us']:>7.2f} "
                     f"{r['pct_floor']:>5.0f}% {r['check_rel_err']:>8.1e}"
                     + (" " + ",".join(f"{k}={v}" for k, v in r["override"].items()) if r.get("override") else "")
                     + (f" ({r['layers']} layers: us per layer step)" if r.get("layers", 1) > 1 else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    out_dir = Path(args.out or os.environ.get("OUT") or REPO / "benchmarks" / "out")
    rows = []
    if args.dry_run:
        for s in shapes(args):
            m = verify_bytes(s["B"], s["HV"], s["HV"], 128, 128, args.ring, args.drafts, args.accept,
                             DTYPES[s["state"]].itemsize, predecayed=args.layout == "predecayed")
            log.info("HV=%d B=%d %s: %.2f MB per verify step (checkpoint %.2f MB, fold share %.2f, mean cursor %.1f)",
                     s["HV"], s["B"], s["state"], m["bytes"] / 1e6, m["checkpoint_read"] / 1e6, m["fold_share"],
                     m["mean_cursor"])
        return 0
    os.environ.setdefault("HELION_AUTOTUNE_EFFORT", "none")
    from bench_decode import measure_copy_bandwidth

    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 * 2**20)
    bw = measure_copy_bandwidth(torch.device("cuda"), 1024)
    log.info("%s, copy bandwidth %.0f GB/s", props.name, bw["copy_gbps"])
    out_dir.mkdir(parents=True, exist_ok=True)
    import tp_replayssm

    meta = {"argv": sys.argv, "device": props.name, "copy_gbps": bw["copy_gbps"], "torch": torch.__version__,
            "package": tp_replayssm.__file__,  # which checkout an A/B side timed (run_device_ab.sh)
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    for s in shapes(args):
        try:
            rows.append(run_shape(s, args, l2, bw["copy_gbps"]))
        except Exception as exc:  # noqa: BLE001 - one failing shape must not lose the others
            log.exception("shape %s failed", s)
            rows.append({**s, "error": f"{type(exc).__name__}: {exc}"[:200]})
        log.info(table(rows[-1:])[-1])
        if "kernel_us" in rows[-1]:
            log.info("  kernels (us per step): %s", rows[-1]["kernel_us"])
        # after every shape, so that a run cut by a time limit keeps the rows it timed
        (out_dir / "bench_spec.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
