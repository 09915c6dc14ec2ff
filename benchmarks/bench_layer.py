#!/usr/bin/env python3
"""One KDA layer's decode step on one GPU: ``TPKimiDeltaAttention`` (projections, the pool's conv, the recurrence,
gated norm, ``o_proj``) against flash-linear-attention 0.6.0's ``KimiDeltaAttention`` decode step with its own cache,
graph-captured, averaged over every cursor phase; and the share of our step the recurrence takes.

Shapes: Kimi-Linear's layer (hidden 2304, H = HV = 32 heads, K = V = 128, conv 4, gate rank 128) at TP1 (32 heads on
the GPU) and at TP8 (one rank's shard: 4 heads, ``o_proj [2304, 512]``; the all-reduce over the 8 ranks is not in
the timing), batches 1, 8, 64, 256. Both layers are built from the same FLA layer of the rank's heads (bf16).

What it measures, per shape (us per decode step; one CUDA graph per measurement holds, for each of ``n_sets``
disjoint slot sets, a full cursor cycle of ``L`` steps: cursors 0 .. L-1, the last one flushing, so every ring phase
is averaged; enough sets that a replay touches ``--footprint-mb`` of state):

- ``layer_us``: ``layer(x, slots, advance=True)``, the whole decode step (the cursor advance fused into the
  recurrence's launch);
- its parts, each graph-captured alone on the same sets: ``proj_us`` (the fused input projection and the low-rank
  gate halves: three GEMMs), ``conv_us`` (``pool.conv_update``), ``rec_us`` (``pool.decode`` of post-conv inputs with
  the fused advance: the Helion recurrence kernel), ``out_us`` (gated RMSNorm and ``o_proj``); ``rec_share = rec_us /
  layer_us``;
- ``fla_us``: FLA's layer on ``x [B, 1, hidden]`` with its ``Cache`` (one per slot set), and ``fla_rec_us``: its
  recurrence alone (``fused_recurrent_kda`` on the layer's q/k/v/g/beta for ``B`` sequences of one token, the call
  the layer makes), ``fla_rec_share``. FLA's graph replays the captured step (its cache object points at the
  captured outputs, so a replay reads the same input state again: the same work as a real step).
  ``speedup = fla_us / layer_us``.
- Before timing: three decode steps of both layers from an empty state on the same inputs (``check_rel``: max abs
  error over max abs output; bf16, so about 1e-2 is expected, 5e-2 fails the shape).

Commands (the device; ``source benchmarks/device_setup.sh`` first)::

    python3 benchmarks/bench_layer.py                       # TP1 and TP8, B = 1, 8, 64, 256 (~2 min)
    python3 benchmarks/bench_layer.py --tp 8 --batch 64     # one shape
    python3 benchmarks/bench_layer.py --device cpu --hidden 64 --heads 2 --head-dim 16 --tp 1 --batch 2 --no-fla \\
        --ring-length 4   # a smoke run on a CPU (wall-clock, no graphs; tests/test_bench_layer.py runs it)

Prints one table and writes ``bench_layer.json`` into ``--out`` (else ``$OUT``, else ``benchmarks/out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--hidden", type=int, default=2304)
    p.add_argument("--heads", type=int, default=32, help="the layer's heads (H = HV) at TP1")
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--tp", default="1,8", help="tensor-parallel sizes: a rank holds heads/tp heads")
    p.add_argument("--batch", default="1,8,64,256", help="decode rows per step")
    p.add_argument("--ring-length", type=int, default=16)
    p.add_argument("--state", choices=("fp32", "bf16"), default="fp32", help="checkpoint dtype")
    p.add_argument("--footprint-mb", type=float, default=256.0, help="state bytes one replay touches (at least)")
    p.add_argument("--max-sets", type=int, default=32, help="cap on slot sets per graph")
    p.add_argument("--inputs", type=int, default=4, help="distinct input sets rotated over the steps")
    p.add_argument("--rep-ms", type=float, default=150.0, help="time spent replaying each graph")
    p.add_argument("--no-fla", action="store_true", help="ours only (no FLA layer, no check)")
    p.add_argument("--out", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- timing ----------------------------------------------------------------------------------------------------------


def measure(fn: Callable[[], None], steps: int, args: argparse.Namespace) -> float:
    """us per step of ``fn`` (which runs ``steps`` steps): a CUDA graph's median replay (bench_decode.GraphRun), or
    on a CPU the median wall time of a few calls."""
    if args.device == "cuda":
        from bench_decode import GraphRun

        return GraphRun(fn, steps).measure(args.rep_ms, 5, 2000)["us"]
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 / steps


# ---- one shape -------------------------------------------------------------------------------------------------------


def run_shape(tp: int, B: int, args: argparse.Namespace, fla_layers: Any, fla_rec: Any) -> dict[str, Any]:
    """One (tp, B) record. ``fla_layers``: the ``fla`` package with its layers, or None; ``fla_rec``: FLA's
    ``fused_recurrent_kda``, or None."""
    from tp_replayssm import KDAHeads, ReplaySSMStatePool
    from tp_replayssm.layers import TPKimiDeltaAttention

    dev = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    n, K, L, D = args.heads // tp, args.head_dim, args.ring_length, args.hidden
    rec: dict[str, Any] = dict(tp=tp, B=B, heads_local=n, hidden=D, K=K, L=L, state=args.state)
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if fla_layers is not None:
        fla_layer = fla_layers.layers.KimiDeltaAttention(hidden_size=D, num_heads=n, head_dim=K, conv_size=4,
                                                  layer_idx=0).to(dev, dtype).eval()
        for p in fla_layer.parameters():
            p.requires_grad_(False)
        source = dict(fla_layer=fla_layer)
    else:
        from _layer_helpers import random_weights  # tests/ is beside benchmarks/: the same weights as the tests

        from tp_replayssm.layers import KDALayerConfig

        cfg = KDALayerConfig(D, n, n, K, K, K, conv_size=4)
        source = dict(weights=random_weights(cfg, args.seed), cfg=cfg)
    heads = KDAHeads(n, n, K, K)
    probe = ReplaySSMStatePool(heads, num_layers=1, num_slots=1, ring_length=L, conv_kernel_size=4,
                               state_dtype=getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[args.state]),
                               device=dev)
    per_set = probe.memory.per_slot * B
    del probe
    sets = int(max(1, min(math.ceil(args.footprint_mb * 2**20 / per_set), args.max_sets)))
    pool = ReplaySSMStatePool(heads, num_layers=1, num_slots=sets * B, ring_length=L, conv_kernel_size=4,
                              state_dtype=getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[args.state]),
                              device=dev)
    if fla_layers is not None:
        layer = TPKimiDeltaAttention.from_fla(source["fla_layer"], pool=pool, layer_idx=0)
    else:
        layer = TPKimiDeltaAttention.from_state_dict(source["weights"], source["cfg"], pool=pool, layer_idx=0,
                                                     dtype=dtype)
    slot_sets = [pool.alloc(B) for _ in range(sets)]
    g = torch.Generator(device=dev).manual_seed(args.seed)
    xs = [torch.randn(B, D, device=dev, dtype=dtype, generator=g) for _ in range(args.inputs)]
    rec.update(n_sets=sets, slots=sets * B, graph_steps=sets * L, pool_mib=pool.memory.total / 2**20)

    if fla_layers is not None:  # correctness: three steps of both from an empty state
        from fla.models.utils import Cache

        cache, err = Cache(), 0.0
        with torch.no_grad():
            for t in range(3):
                ours = layer(xs[t % len(xs)], slot_sets[0], advance=True)
                theirs, _, cache = source["fla_layer"](xs[t % len(xs)][:, None], past_key_values=cache, use_cache=True)
                err = max(err, float((ours.float() - theirs[:, 0].float()).abs().max()
                                     / theirs.float().abs().max().clamp_min(1e-30)))
        rec["check_rel"] = err
        rec["check"] = "ok" if err < 5e-2 else "WRONG"
        for s in slot_sets:  # back to fresh slots (state, ring, conv window, cursor 0)
            pool.free(s)
        slot_sets = [pool.alloc(B) for _ in range(sets)]

    def cycle(step: Callable[[int, torch.Tensor, int], None]) -> Callable[[], None]:
        def run() -> None:
            for si, slots in enumerate(slot_sets):
                for t in range(L):
                    step(si, slots, (si * L + t) % len(xs))
        return run

    steps = sets * L
    with torch.no_grad():
        rec["layer_us"] = measure(cycle(lambda si, s, j: layer(xs[j], s, advance=True)), steps, args)
        projected = [layer._project(x) for x in xs]  # (mixed pre-conv, a, b, gate)
        rec["proj_us"] = measure(cycle(lambda si, s, j: layer._project(xs[j])), steps, args)
        rec["conv_us"] = measure(cycle(lambda si, s, j: pool.conv_update(0, projected[j][0], layer.conv_weight, s,
                                                                         bias=layer.conv_bias)), steps, args)
        post = [pool.conv_update(0, m.contiguous(), layer.conv_weight, slot_sets[0], bias=layer.conv_bias)
                for m, _, _, _ in projected]
        rec["rec_us"] = measure(cycle(lambda si, s, j: pool.decode(0, post[j], projected[j][1], projected[j][2],
                                                                   layer.A_log, layer.dt_bias, s, advance=True)),
                                steps, args)
        outs = [torch.randn(B, n, K, device=dev, dtype=dtype, generator=g) for _ in xs]
        rec["out_us"] = measure(cycle(lambda si, s, j: layer._output(outs[j], projected[j][3])), steps, args)
        rec["rec_share"] = rec["rec_us"] / rec["layer_us"]
        if fla_layers is not None:
            rec["fla_us"] = fla_layer_us(source["fla_layer"], xs, sets, L, args)
            rec["speedup"] = rec["fla_us"] / rec["layer_us"]
        if fla_rec is not None:
            rec["fla_rec_us"] = fla_rec_us(fla_rec, layer, post, projected, sets, L, B, n, K, args)
            if "fla_us" in rec:
                rec["fla_rec_share"] = rec["fla_rec_us"] / rec["fla_us"]
    pool.check()
    return rec


def fla_layer_us(fla_layer: Any, xs: list[torch.Tensor], sets: int, L: int, args: argparse.Namespace) -> float:
    """FLA's layer step with one Cache per slot set (module docstring)."""
    from fla.models.utils import Cache

    caches = []
    for _ in range(sets):  # each cache holds B sequences' states after one step
        cache = Cache()
        fla_layer(xs[0][:, None], past_key_values=cache, use_cache=True)
        caches.append(cache)

    def layer_cycle() -> None:
        for si in range(sets):
            for t in range(L):
                fla_layer(xs[(si * L + t) % len(xs)][:, None], past_key_values=caches[si], use_cache=True)

    return measure(layer_cycle, sets * L, args)


def fla_rec_us(fused_recurrent_kda: Any, layer: Any, post: list[torch.Tensor], projected: list[tuple], sets: int,
               L: int, B: int, n: int, K: int, args: argparse.Namespace) -> float:
    """FLA's recurrence alone: ``fused_recurrent_kda`` on the layer's post-conv q/k/v, gate and beta logits for
    ``B`` sequences of one token, one state per slot set (the call FLA's layer makes on a decode step)."""
    states = [torch.zeros(B, n, K, K, device=post[0].device, dtype=torch.float32) for _ in range(sets)]
    HK = n * K
    split = [(m[:, :HK].reshape(B, 1, n, K).contiguous(), m[:, HK:2 * HK].reshape(B, 1, n, K).contiguous(),
              m[:, 2 * HK:].reshape(B, 1, n, K).contiguous(), a.reshape(B, 1, n, K).contiguous(),
              b.reshape(B, 1, n).contiguous()) for m, (_, a, b, _) in zip(post, projected)]

    def rec_cycle() -> None:
        for si in range(sets):
            for t in range(L):
                q, k, v, g, beta = split[(si * L + t) % len(split)]
                fused_recurrent_kda(q=q, k=k, v=v, g=g, beta=beta, A_log=layer.A_log, dt_bias=layer.dt_bias,
                                    initial_state=states[si], output_final_state=True, use_qk_l2norm_in_kernel=True,
                                    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)

    return measure(rec_cycle, sets * L, args)


# ---- main ------------------------------------------------------------------------------------------------------------


COLUMNS = ("tp", "B", "n_sets", "layer_us", "proj_us", "conv_us", "rec_us", "out_us", "rec_share", "fla_us",
           "fla_rec_us", "fla_rec_share", "speedup", "check_rel", "check")


def table(records: list[dict[str, Any]]) -> list[str]:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if v < 10 else f"{v:.1f}"
        return "-" if v is None else str(v)

    rows = [COLUMNS] + [tuple(fmt(r.get(c)) for c in COLUMNS) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]


def load_fla(off: bool) -> tuple[Any, Any]:
    """``(fla with its layers, fused_recurrent_kda)``, each None when not importable (FLA's layers need
    flash-linear-attention and transformers; its recurrence only fla-core) or ``off``."""
    if off:
        return None, None
    fla_layers = fla_rec = None
    try:
        from fla.ops.kda import fused_recurrent_kda

        fla_rec = fused_recurrent_kda
    except Exception as exc:  # noqa: BLE001 - reported, the run goes on without it
        log(f"bench_layer: FLA's recurrence is not importable ({type(exc).__name__}: {exc}); no fla_rec_us")
    try:
        import fla
        import fla.layers  # noqa: F401
        import fla.models.utils  # noqa: F401

        fla_layers = fla
    except Exception as exc:  # noqa: BLE001
        log(f"bench_layer: FLA's layers are not importable ({type(exc).__name__}: {exc}); no fla_us and no check "
            "(flash-linear-attention needs transformers and its dependencies)")
    return fla_layers, fla_rec


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        log("bench_layer: no CUDA device is visible; run it on the GPU machine (or --device cpu for a smoke run)")
        return 2
    sys.path.insert(0, str(REPO / "tests"))  # without FLA's layers: the tests' random weights (_layer_helpers)
    fla_layers, fla_rec = load_fla(args.no_fla)
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                fla=getattr(fla_layers, "__version__", None), fla_layers=fla_layers is not None,
                fla_recurrence=fla_rec is not None, argv=list(sys.argv[1:] if argv is None else argv))
    log(f"bench_layer: {meta['device']}, torch {meta['torch']}, fla {meta['fla']}; hidden {args.hidden}, "
        f"{args.heads} heads at TP1, K=V={args.head_dim}, L={args.ring_length}, state {args.state}")
    records, failed = [], 0
    out = Path(args.out or os.environ.get("OUT") or REPO / "benchmarks" / "out")
    out.mkdir(parents=True, exist_ok=True)
    for tp in (int(t) for t in args.tp.split(",")):
        for B in (int(b) for b in args.batch.split(",")):
            try:
                rec = run_shape(tp, B, args, fla_layers, fla_rec)
            except Exception as exc:  # noqa: BLE001 - one shape's failure is recorded, the sweep goes on
                rec = dict(tp=tp, B=B, error=f"{type(exc).__name__}: {exc}"[:300])
                log(f"tp {tp} B {B}: FAILED {rec['error']}")
                failed += 1
            records.append(rec)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            log(f"tp {tp} B {B}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in rec.items() if k not in ("tp", "B")))
            # after every shape, so that a run cut by a time limit keeps the shapes it timed
            (out / "bench_layer.json").write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    log("== bench_layer (us per decode step; rec_share = the recurrence's share of our layer step)")
    for line in table(records):
        log(line)
    wrong = sum(r.get("check") == "WRONG" for r in records)
    log(f"wrote {out / 'bench_layer.json'}; {failed} shapes failed, {wrong} checks WRONG")
    return 1 if failed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
