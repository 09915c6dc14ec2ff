#!/usr/bin/env python3
"""A request's life in the pool on one GPU: ``pool.fork``, ``export_state`` and ``import_state``.

Pools of the Kimi-Linear shape per rank at TP8 and at TP1 (``--heads``: local value heads = local q/k heads,
default 4 and 32; K = V = 128, 20 layers, ring L = 16, bf16 rings, conv kernel 4), fp32 and bf16 checkpoints; every
allocated slot holds random data with its cursor mid-ring, so an export replays real ring entries.

1. ``fork``: one call forking ``pairs`` slots (``--pairs``, default 1 and 8) across every layer (checkpoint, rings,
   cursor, conv window), graph-captured: one graph replays ``calls`` fork calls on disjoint slots (together at
   least 4x L2 of bytes moved); ``us`` = median replay / calls of ``pool.fork`` (on CUDA the one-launch fork kernel,
   ``path``); ``GB/s`` = bytes read + written / time. ``floor_us`` is a plain device copy of the same bytes,
   captured the same way (what the data movement alone costs), ``padded_us`` a call of ``pairs`` pairs of which all
   but one are padding (``dst = -1``: the kernel's programs of a padding pair copy nothing; the torch ops move a
   whole slot for every pair), and ``torch_us`` the same forks through the torch ops
   (``tp_replayssm.pool.lifecycle.fork_torch``, the CPU path) for comparison. After timing every destination must
   equal its source bit for bit (``check``).
2. ``export``: ``export_state`` of ``n`` slots (``--export-slots``) to pinned CPU memory, blocking and with
   ``non_blocking=True`` (until ``wait()`` returns); ``GB/s`` = shard bytes (fp32 states + conv windows) / time,
   against ``d2h_GB/s``, a pinned device -> host copy of the same bytes measured in the same run.
3. ``import``: ``import_state`` of those shards into other slots; ``GB/s`` against ``h2d_GB/s`` (pinned host ->
   device). ``check``: the imported slots' ``read_state`` equals the shard (rounded to the state dtype).

    source benchmarks/device_setup.sh && python3 benchmarks/bench_lifecycle.py     # the H200 run (~2-4 min)
    python3 benchmarks/bench_lifecycle.py --smoke                                   # CPU, tiny, eager timings

Writes ``bench_lifecycle.json`` (meta and one record per measurement) into ``--out`` (else ``$OUT``, else
``benchmarks/out``) and prints the table after a line ``== bench_lifecycle``. Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def log(*args: object) -> None:
    print(*args, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="fork / export_state / import_state of the pool, on one GPU.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--heads", default="4,32", help="local value heads (= local q/k heads), comma list")
    p.add_argument("--states", default="fp32,bf16", help="checkpoint dtypes, comma list")
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--key-dim", type=int, default=128)
    p.add_argument("--value-dim", type=int, default=128)
    p.add_argument("--ring", type=int, default=16)
    p.add_argument("--cache-dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--conv", type=int, default=4, help="conv kernel size (0: no conv state)")
    p.add_argument("--ring-layout", default="predecayed", choices=["predecayed", "sglang"])
    p.add_argument("--pairs", default="1,8", help="fork pairs per call, comma list")
    p.add_argument("--export-slots", default="1,8,32", help="slots per export/import, comma list")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions (median) of export/import and copies")
    p.add_argument("--rep-ms", type=float, default=200.0, help="graph replays: about this long in total")
    p.add_argument("--footprint-mb", type=float, default=0.0, help="fork bytes per graph replay (0: 4x L2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda (default) or cpu (eager timings)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, few reps (the CPU test)")
    p.add_argument("--out", help="output folder (default $OUT, else benchmarks/out)")
    args = p.parse_args(argv)
    if args.smoke:
        args.device = args.device or "cpu"
        args.heads, args.layers, args.key_dim, args.value_dim, args.ring = "2", 2, 16, 16, 4
        args.export_slots, args.pairs, args.reps, args.footprint_mb = "1,3", "1,2", 3, 0.05
    args.device = torch.device(args.device or "cuda")
    return args


def out_dir(args: argparse.Namespace) -> Path:
    d = Path(args.out or os.environ.get("OUT") or REPO / "benchmarks" / "out")
    d.mkdir(parents=True, exist_ok=True)
    return d


# ---- timing --------------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_us(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    """Median wall time of ``fn`` (synchronized before and after each call), microseconds."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def graph_us(fn: Callable[[], None], calls: int, args: argparse.Namespace) -> float:
    """Per-call time of ``fn`` (which makes ``calls`` calls): one CUDA graph of it, median replay time / calls
    (eager wall time on the CPU)."""
    if args.device.type != "cuda":
        return wall_us(fn, args.reps, args.device) / calls
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    reps = int(min(max(args.rep_ms * 1e-3 / max(time.perf_counter() - t0, 1e-6), 10), 500))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / calls


def copy_gbps(nbytes: int, direction: str, args: argparse.Namespace) -> float:
    """Bandwidth of a plain copy of ``nbytes``: ``d2h`` / ``h2d`` between the device and pinned host memory, or
    ``d2d`` on the device (read + write counted)."""
    dev = args.device
    n = max(1, nbytes // 4)
    pinned = dev.type == "cuda"
    host = torch.empty(n, dtype=torch.float32, pin_memory=pinned)
    devt = torch.empty(n, dtype=torch.float32, device=dev)
    if direction == "d2h":
        us = wall_us(lambda: host.copy_(devt, non_blocking=pinned), args.reps, dev)
    elif direction == "h2d":
        us = wall_us(lambda: devt.copy_(host, non_blocking=pinned), args.reps, dev)
    else:
        other = torch.empty_like(devt)
        us = graph_us(lambda: other.copy_(devt), 1, args)
        return 2 * n * 4 / us / 1e3
    return n * 4 / us / 1e3


# ---- the pool ------------------------------------------------------------------------------------------------------


def make_pool(HV: int, state: str, num_slots: int, args: argparse.Namespace) -> Any:
    """A pool of ``num_slots`` slots, all allocated, every tensor random (gates small and negative, cursors
    mid-ring), so exports replay real ring entries."""
    from tp_replayssm import KDAHeads, ReplaySSMStatePool

    pool = ReplaySSMStatePool(KDAHeads(HV, HV, args.key_dim, args.value_dim), num_layers=args.layers,
                              num_slots=num_slots, ring_length=args.ring, state_dtype=DTYPES[state],
                              cache_dtype=DTYPES[args.cache_dtype], ring_layout=args.ring_layout,
                              conv_kernel_size=args.conv, device=args.device)
    pool.alloc(num_slots)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    for t, scale in ((pool.checkpoint, 0.05), (pool.d_cache, 0.1), (pool.k_cache, 0.1)):
        t.copy_(torch.randn(t.shape, generator=gen, device=args.device, dtype=torch.float32).mul_(scale))
    g = torch.rand(pool.g_cache.shape, generator=gen, device=args.device).mul_(-0.05)
    pool.g_cache.copy_(g.cumsum(3) if pool.predecayed else g)
    if pool.conv_state is not None:
        pool.conv_state.copy_(torch.randn(pool.conv_state.shape, generator=gen, device=args.device))
    cursors = torch.randint(1, args.ring, (num_slots,), generator=gen, device=args.device, dtype=torch.int32)
    pool.cursors[:num_slots] = cursors
    return pool


def slot_bytes(pool: Any) -> int:
    """Bytes of one slot over every layer (checkpoint, rings, conv window) plus its cursor: what a fork moves."""
    m = pool.memory
    return m.per_slot_layer * pool.num_layers + m.cursor_per_slot


def shard_bytes(shard: Any) -> int:
    total = shard.states.numel() * shard.states.element_size()
    if shard.conv_states is not None:
        total += shard.conv_states.numel() * shard.conv_states.element_size()
    return total


# ---- the measurements ----------------------------------------------------------------------------------------------


def bench_fork(HV: int, state: str, args: argparse.Namespace, l2_bytes: int, records: list[dict]) -> None:
    from tp_replayssm.kernels.backend import runs_kernel
    from tp_replayssm.kernels.fork import pool_words
    from tp_replayssm.pool.lifecycle import fork_torch

    dev = args.device
    probe = make_pool(HV, state, 2, args)
    per_slot = slot_bytes(probe)
    del probe
    target = args.footprint_mb * 2**20 if args.footprint_mb > 0 else 4 * l2_bytes
    for pairs in [int(x) for x in args.pairs.split(",")]:
        calls = max(1, math.ceil(target / (2 * per_slot * pairs)))
        calls = min(calls, max(1, (2**34 // (2 * per_slot * pairs))))  # at most ~16 GiB of slots
        pool = make_pool(HV, state, 2 * pairs * calls, args)
        src = [torch.arange(2 * i * pairs, (2 * i + 1) * pairs, dtype=torch.int32, device=dev) for i in range(calls)]
        dst = [s + pairs for s in src]
        padded = [torch.where(torch.arange(pairs, device=dev) == 0, d, -1).to(torch.int32) for d in dst]

        guard = pool.guard("fork")

        def forks(dsts: list[torch.Tensor] = dst) -> None:
            for s, d in zip(src, dsts):
                pool.fork(s, d)

        def torch_forks() -> None:
            for s, d in zip(src, dst):
                fork_torch(pool, s, d, guard)

        us = graph_us(forks, calls, args)
        pad_us = graph_us(lambda: forks(padded), calls, args)
        torch_us = graph_us(torch_forks, calls, args)
        path = "kernel" if runs_kernel(dev, "bench_lifecycle") and pool_words(pool) is not None else "torch"
        nbytes = 2 * per_slot * pairs
        floor = nbytes / (copy_gbps(nbytes // 2, "d2d", args) * 1e3)
        sync(dev)
        ok = all(torch.equal(getattr(pool, n)[:, d.long()], getattr(pool, n)[:, s.long()])
                 for s, d in zip(src, dst) for n in ("checkpoint", "d_cache", "k_cache", "g_cache", "conv_state")
                 if getattr(pool, n) is not None)
        ok = ok and all(torch.equal(pool.cursors[d.long()], pool.cursors[s.long()]) for s, d in zip(src, dst))
        try:
            pool.check()
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            ok = False
            log(f"  fork check: {exc}")
        records.append(dict(kind="fork", HV=HV, state=state, pairs=pairs, calls=calls, bytes=nbytes, us=us,
                            GBps=nbytes / us / 1e3, floor_us=floor, padded_us=pad_us, torch_us=torch_us, path=path,
                            check="ok" if ok else "WRONG: a destination differs from its source"))
        del pool


def bench_export_import(HV: int, state: str, args: argparse.Namespace, records: list[dict]) -> None:
    dev = args.device
    sizes = [int(x) for x in args.export_slots.split(",")]
    pool = make_pool(HV, state, 2 * max(sizes), args)
    for n in sizes:
        src = torch.arange(n, dtype=torch.int32, device=dev)
        dst = src + max(sizes)
        shard = pool.export_state(src)
        nbytes = shard_bytes(shard)
        us_block = wall_us(lambda: pool.export_state(src), args.reps, dev)
        us_async = wall_us(lambda: pool.export_state(src, non_blocking=True).wait(), args.reps, dev)
        d2h = copy_gbps(nbytes, "d2h", args)
        records.append(dict(kind="export", HV=HV, state=state, slots=n, bytes=nbytes, us=us_block,
                            GBps=nbytes / us_block / 1e3, async_us=us_async, async_GBps=nbytes / us_async / 1e3,
                            copy_GBps=d2h, pct_of_copy=100 * nbytes / us_block / 1e3 / d2h))
        us_imp = wall_us(lambda: pool.import_state(dst, [shard]), args.reps, dev)
        h2d = copy_gbps(nbytes, "h2d", args)
        ok = True
        for layer in range(pool.num_layers):
            got = pool.read_state(layer, dst).cpu()
            want = shard.states[layer].to(pool.state_dtype).float()
            ok &= torch.equal(got, want)
            if pool.conv_state is not None:
                ok &= torch.equal(pool.read_conv_state(layer, dst).cpu(), shard.conv_states[layer])
        records.append(dict(kind="import", HV=HV, state=state, slots=n, bytes=nbytes, us=us_imp,
                            GBps=nbytes / us_imp / 1e3, copy_GBps=h2d, pct_of_copy=100 * nbytes / us_imp / 1e3 / h2d,
                            check="ok" if ok else "WRONG: an imported state differs from the shard"))
        for direction, gbps in (("d2h", d2h), ("h2d", h2d)):
            records.append(dict(kind="copy", direction=direction, bytes=nbytes, GBps=gbps,
                                pinned=dev.type == "cuda"))
    del pool


# ---- report --------------------------------------------------------------------------------------------------------


def table(records: list[dict]) -> str:
    lines = ["kind    HV state  n     MB        us     GB/s  vs (us or GB/s)        check"]
    for r in records:
        mb = r["bytes"] / 2**20
        if r["kind"] == "fork":
            ref = (f"floor {r['floor_us']:.1f} us, padded {r['padded_us']:.1f} us, torch ops {r['torch_us']:.1f} us "
                   f"({r['path']})")
            lines.append(f"fork    {r['HV']:2d} {r['state']:5s} {r['pairs']:3d} {mb:8.2f} {r['us']:9.1f} "
                         f"{r['GBps']:8.1f}  {ref:22s} {r['check']}")
        elif r["kind"] in ("export", "import"):
            ref = f"copy {r['copy_GBps']:.1f} GB/s ({r['pct_of_copy']:.0f}%)"
            extra = f", async {r['async_us']:.1f} us" if r["kind"] == "export" else ""
            lines.append(f"{r['kind']:7s} {r['HV']:2d} {r['state']:5s} {r['slots']:3d} {mb:8.2f} {r['us']:9.1f} "
                         f"{r['GBps']:8.1f}  {ref + extra:22s} {r.get('check', '')}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    dev = args.device
    meta: dict[str, Any] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(["bench_lifecycle.py", *argv]), python=platform.python_version(), host=platform.node(),
        torch=torch.__version__, cuda=torch.version.cuda, args={k: str(v) for k, v in vars(args).items()})
    l2_bytes = 50 * 2**20
    if dev.type == "cuda":
        if dev.index is None:
            dev = args.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        props = torch.cuda.get_device_properties(dev)
        l2_bytes = int(getattr(props, "L2_cache_size", 0) or l2_bytes)
        meta.update(gpu=props.name, l2_bytes=l2_bytes)
    log(f"bench_lifecycle on {meta.get('gpu', dev)}: heads {args.heads}, states {args.states}, {args.layers} layers, "
        f"K={args.key_dim} V={args.value_dim} L={args.ring}, {args.cache_dtype} rings, conv {args.conv}")
    records: list[dict] = []
    for HV in [int(x) for x in args.heads.split(",")]:
        for state in args.states.split(","):
            t0 = time.perf_counter()
            bench_fork(HV, state, args, l2_bytes, records)
            bench_export_import(HV, state, args, records)
            log(f"  HV={HV} state={state}: {time.perf_counter() - t0:.1f} s")
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    path = out_dir(args) / "bench_lifecycle.json"
    path.write_text(json.dumps(dict(meta=meta, records=records), indent=1))
    log("== bench_lifecycle " + ("(CPU smoke: eager wall times, not comparable)" if dev.type != "cuda" else ""))
    log(table(records))
    bad = [r for r in records if r.get("check", "ok") != "ok"]
    log(f"wrote {path}; {len(bad)} failed check(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
