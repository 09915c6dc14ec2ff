"""Launch-plan sweep of the decode op on a GPU: the library's plan against candidate plans, shape by shape.

For each shape (``--hv`` x ``--batch`` x ``--state``, H = HV, K = V = 128) and each candidate, one full cursor cycle
(``L`` steps, every row at cursor 0 .. L-1, the last one flushes) of the op on row cursors, over enough disjoint
slot sets that the checkpoints and rings stream from DRAM (``--footprint-mib``), captured in CUDA graphs of at least
256 launches and replayed; prints us/step (median of replays / steps) per candidate and the best per shape. A
candidate is an ``--override`` string, ``field=value,...`` of ``tp_replayssm.kernels.plan.DecodePlan`` applied to the
library's plan of each shape (``benchmarks/plan_args.py``); ``default`` is the library's plan itself. A candidate
that cannot run a shape (``DecodePlan.check``) is reported as skipped there. The measurements behind the library's
rules are in ``docs/tuning.md``.

    python3 benchmarks/tune_decode.py --hv 32 8 --batch 1 8 32 128 512 --state fp32 bf16
    python3 benchmarks/tune_decode.py --hv 8 --batch 128 --state bf16 \\
        --override value_tile=64 "value_tile=32,num_warps=1" tensor_core_chunks=false --tag vt

Writes ``$OUT/<tag>.json`` (default ``tune``; ``copy_bw`` and one row per (shape, candidate): ``HV, B, state,
config, us``, and the plan) after every shape, and prints each timing, the registers of every compiled kernel and
the best candidate per shape. ``profile_decode.py`` builds its problem with :func:`make_problem`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plan_args import build_plan, override_arg  # noqa: E402


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(2 * 1024**3 // 4, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        s.record()
        y.copy_(x)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * x.numel() * 4 / statistics.median(times)


def make_problem(B: int, H: int, HV: int, L: int, state_dtype: torch.dtype, n_sets: int, K: int = 128, V: int = 128,
                 ring_layout: str = "predecayed", device: str = "cuda") -> dict:
    """Caches of ``n_sets`` disjoint slot sets (every ring entry filled, in ``ring_layout``), inputs per cursor
    phase, bf16 ``out``, the slot sets and one constant cursor tensor per phase."""
    from tp_replayssm.testing import random_decode_inputs, random_head_params, random_ring_caches

    S = B * n_sets
    dev = torch.device(device)
    st, d, kc, g = random_ring_caches(S, H, HV, K, V, L, state_dtype=state_dtype,
                                      predecayed=ring_layout == "predecayed", device=dev)
    p = random_head_params(HV, K, device=dev)
    inputs = [random_decode_inputs(B, H, HV, K, V, device=dev) for _ in range(L)]
    out = torch.empty(B, 1, HV, V, dtype=torch.bfloat16, device=dev)
    slot_sets = [torch.arange(i * B, (i + 1) * B, dtype=torch.int32, device=dev) for i in range(n_sets)]
    cursors = [torch.full((B,), c, dtype=torch.int32, device=dev) for c in range(L)]
    return dict(st=st, d=d, kc=kc, g=g, p=p, inputs=inputs, out=out, slot_sets=slot_sets, cursors=cursors)


def slot_sets(B: int, HV: int, L: int, state_dtype: torch.dtype, footprint_mib: float, K: int = 128,
              V: int = 128, max_sets: int = 256) -> int:
    """How many disjoint slot sets one timing cycles through: enough that the checkpoints and rings they hold exceed
    ``footprint_mib`` (at most ``max_sets``); ``footprint_mib`` 0: at most 16 sets of at most 512 MiB of
    checkpoints in all (which leaves batches up to 8 rows resident in the H200's L2)."""
    if footprint_mib <= 0:
        return max(1, min(16, (512 * 1024**2) // (B * HV * K * V * state_dtype.itemsize)))
    per_set = B * HV * (V * K * state_dtype.itemsize + L * V * 2 + L * K * 2 + L * K * 4)
    return max(1, min(max_sets, math.ceil(footprint_mib * 1024**2 / per_set)))


def graph_groups(n_sets: int, L: int, min_launches: int = 256) -> list[range]:
    """Slot-set indices per CUDA graph: consecutive sets, enough for ``min_launches`` op launches per graph. With
    one graph per set (16 launches) the gap between graph replays lands in every step: on the H200 at B = 1,
    6.2 us/step instead of 3.9 with 16 sets per graph."""
    per = max(1, math.ceil(min_launches / L))
    return [range(i, min(i + per, n_sets)) for i in range(0, n_sets, per)]


def time_cycle(prob: dict, launch, L: int, reps: int = 20, min_launches: int = 256) -> float:  # noqa: ANN001
    """us per step, averaged over full cycles (every phase incl. the flush), graphs of whole cycles of
    several slot sets (:func:`graph_groups` with ``min_launches``)."""
    sets = prob["slot_sets"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for slots in sets:  # warm-up/compile outside capture
            for c in range(L):
                launch(prob, slots, c)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs = []
    for group in graph_groups(len(sets), L, min_launches):
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for i in group:
                for c in range(L):
                    launch(prob, sets[i], c)
        graphs.append(gr)
    for gr in graphs:
        gr.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        for gr in graphs:
            gr.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / (len(sets) * L))
    return statistics.median(times)


def op_launch(plan=None, ring_layout: str = "predecayed", lower_bound: float | None = None):  # noqa: ANN001, ANN201
    """One step of the op on ``prob``'s caches: ``launch(prob, slots, c)`` decodes the slot set ``slots`` at cursor
    ``c`` with ``plan`` (a ``DecodePlan`` for row cursors; None: the library's own), l2-normalized q/k."""
    from tp_replayssm.kernels.launch import run_decode
    from tp_replayssm.validation import DecodeCall

    def launch(prob: dict, slots: torch.Tensor, c: int) -> None:
        inp, p = prob["inputs"][c], prob["p"]
        call = DecodeCall(inp.mixed_qkv, inp.a, inp.b, p.A_log, p.dt_bias, None, prob["st"], prob["d"], prob["kc"],
                          prob["g"], prob["out"], slots, prob["cursors"][c], None, True, lower_bound)
        run_decode(call, ring_layout=ring_layout, plan=plan)

    return launch


_REPORTED: set = set()


def register_report() -> None:
    """Registers / spills / shared memory of every compiled ReplaySSM Triton kernel not reported yet."""
    import warnings

    import triton

    for mod in list(sys.modules.values()):
        with warnings.catch_warnings():  # reading every module's globals touches deprecated aliases
            warnings.simplefilter("ignore")
            items = list(vars(mod).items()) if hasattr(mod, "__dict__") else []
        for name, obj in items:
            if not (isinstance(obj, triton.runtime.jit.JITFunction) and name.startswith("_helion_replayssm")):
                continue
            for cache in getattr(obj, "device_caches", {}).values():
                for key, k in cache[0].items():
                    tag = (name, id(k))
                    if tag in _REPORTED:
                        continue
                    _REPORTED.add(tag)
                    md = k.metadata
                    print(f"{name}: regs={k.n_regs} spills={k.n_spills} warps={md.num_warps} "
                          f"shared={md.shared} consts={str(key)[-80:]}", flush=True)


def candidate_name(override: dict) -> str:
    """A candidate's name in the output: its ``field=value`` pairs, ``default`` for none."""
    return ",".join(f"{k}={v}" for k, v in override.items()) or "default"


DEFAULT_CANDIDATES = ("value_tile=128", "value_tile=64", "value_tile=32", "value_tile=128,num_warps=4")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hv", type=int, nargs="+", default=[32, 8], help="value heads (H = HV)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--state", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    ap.add_argument("--ring", type=int, default=16)
    ap.add_argument("--override", nargs="+", type=override_arg, metavar="FIELD=VALUE,...",
                    default=[override_arg(c) for c in DEFAULT_CANDIDATES],
                    help="candidate plans: fields of the library's plan to replace (benchmarks/plan_args.py), one "
                         "string per candidate, e.g. 'value_tile=64,num_warps=1' 'tiny_batch=true' "
                         "'maxnreg=none,predecayed_ring=2'; default " + " ".join(DEFAULT_CANDIDATES))
    ap.add_argument("--default-only", action="store_true", help="time the library's plan only")
    ap.add_argument("--ring-layout", choices=["predecayed", "sglang"], default="predecayed",
                    help="the rings' layout: the pool's default pre-decayed one, or SGLang's")
    ap.add_argument("--lower-bound", type=float, default=None, help="the gate's lower_bound (default: none)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this long")
    ap.add_argument("--tag", default="tune", help="name of the results file, $OUT/<tag>.json (default tune): "
                                                  "runs that share $OUT, at once or in turn, each keep their own")
    ap.add_argument("--footprint-mib", type=float, default=240.0,
                    help="cycle through enough disjoint slot sets to touch this much cache memory (checkpoints and "
                         "rings; default 4x the H200's 60 MiB L2, so small batches stream from DRAM as in an engine "
                         "with many layers; 0 = at most 16 sets, L2-resident below B = 8)")
    return ap.parse_args(argv)


def candidates(args: argparse.Namespace) -> list[dict]:
    """The overrides to time at every shape, the library's plan (``{}``) first."""
    return [{}] if args.default_only else [{}] + [o for o in args.override if o]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_decode.py needs a CUDA GPU")
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    t0 = time.monotonic()
    for HV, B, sname in itertools.product(args.hv, args.batch, args.state):
        if time.monotonic() - t0 > args.budget_s:
            print(f"HV={HV} B={B} {sname}: skipped (--budget-s)", flush=True)
            continue
        sdt = torch.float32 if sname == "fp32" else torch.bfloat16
        n_sets = slot_sets(B, HV, args.ring, sdt, args.footprint_mib)
        prob = make_problem(B, HV, HV, args.ring, sdt, n_sets, ring_layout=args.ring_layout)
        for override in candidates(args):
            name = candidate_name(override)
            try:
                plan = build_plan(batch=B, heads=HV, ring_length=args.ring, state=sname, layout=args.ring_layout,
                                  lower_bound=args.lower_bound, override=override)
            except ValueError as exc:
                print(f"HV={HV} B={B} {sname} {name}: skipped, the plan cannot run this shape: {exc}", flush=True)
                continue
            try:
                us = time_cycle(prob, op_launch(plan, args.ring_layout, args.lower_bound), args.ring)
            except Exception as exc:  # noqa: BLE001 - record and go on
                print(f"HV={HV} B={B} {sname} {name}: FAILED {type(exc).__name__}: {str(exc)[-300:]}", flush=True)
                continue
            rows.append(dict(HV=HV, B=B, state=sname, config=name, us=us, plan=dataclasses.asdict(plan)))
            print(f"HV={HV:3d} B={B:4d} {sname} {name:28s} {us:9.2f} us/step", flush=True)
        del prob
        torch.cuda.empty_cache()
        register_report()
        with open(os.path.join(os.environ.get("OUT", "."), f"{args.tag}.json"), "w") as f:  # after every shape
            json.dump(dict(copy_bw=bw, ring_layout=args.ring_layout, lower_bound=args.lower_bound, rows=rows), f,
                      indent=1)
    print("\nbest per shape:")
    for key, grp in itertools.groupby(rows, key=lambda r: (r["HV"], r["B"], r["state"])):
        grp = list(grp)
        best = min(grp, key=lambda r: r["us"])
        dflt = next((r["us"] for r in grp if r["config"] == "default"), float("nan"))
        print(f"HV={key[0]:3d} B={key[1]:4d} {key[2]}: best {best['config']:28s} {best['us']:8.2f} us  "
              f"default {dflt:8.2f} us")


if __name__ == "__main__":
    main()
