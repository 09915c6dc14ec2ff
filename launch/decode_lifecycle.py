"""Requests and their scheduling in the decode engine (``launch/decode.py``): admission, forks, preemptions, finishing.

Every step the engine's rows (``engine.rows``, one per batch row: a :class:`Request` or None, a padding row) change
here. :func:`admit` (before the step) first resumes preempted requests into empty rows, then each empty row admits a
new request with chance ``--arrival`` (``pool.alloc``; a prefill by ``load_state`` with random states
``[n, HV_l, V, K]`` per layer, or with ``--fork-prob P`` and chance ``P`` a ``pool.fork`` of a running request's slot
instead). :func:`finish` (after the step) frees the slots of requests with nothing left to decode, and
:func:`preempt` (``--preempt-prob P``) exports each running request with chance ``P`` to CPU (``pool.export_state``,
asynchronous on CUDA), frees its slot and queues it in ``engine.waiting`` until :func:`resume` imports it into a new
slot (``pool.import_state``).

With either option (``engine.lineage``) the float64 oracle follows every request: its state per layer
(``engine.shadow[rid]``, ``[HV_l, V, K]``) from the prefill, and with ``--conv-size W`` its conv window per layer
(``engine.shadow_win[rid]``, ``[D_l, W-1]``), forked with the request and dropped when it finishes.

All ranks draw the same numbers (``engine.sched`` for arrivals and lengths, ``engine.life`` for forks and
preemptions), so every rank takes the same decisions and row b is the same request on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["Request", "admit", "finish", "fork_sources", "preempt", "resume"]


@dataclasses.dataclass
class Request:
    """One request in a row: its id, its ``slot`` (-1 while preempted) and the tokens it has still to decode."""

    rid: int
    slot: int
    remaining: int  # tokens still to decode
    cursor: int = 0  # host mirror of the pool's ring cursor (for the traffic estimate)
    forked: bool = False  # started as a fork of another request
    resumed: bool = False  # was preempted and resumed at least once


def admit(engine: Any) -> None:
    """Resume preempted requests, then admit new ones into empty rows: forks of running requests or prefills."""
    args = engine.args
    resume(engine)
    empty = [i for i, r in enumerate(engine.rows) if r is None]
    draws = torch.rand(len(empty), generator=engine.sched).tolist()
    lens = torch.randint(args.min_len, args.max_len + 1, (len(empty),), generator=engine.sched).tolist()
    new_rows = [(i, n) for i, d, n in zip(empty, draws, lens) if d < args.arrival]
    if not new_rows:
        return
    sources = fork_sources(engine, len(new_rows))  # per new row: a running request to fork from, or None
    slots = engine.pool.alloc(len(new_rows))
    HV_l, V, K = engine.shard.num_v_heads_local, engine.heads.value_dim, engine.heads.key_dim
    for (row, n), slot, src in zip(new_rows, slots.tolist(), sources):
        cursor = src.cursor if src is not None else 0  # a fork starts at its source's cursor
        engine.rows[row] = Request(engine.next_rid, slot, n, cursor=cursor, forked=src is not None)
        engine.next_rid += 1
    forks = [(src, engine.rows[row]) for (row, _), src in zip(new_rows, sources) if src is not None]
    prefill = [(i, engine.rows[row]) for i, ((row, _), src) in enumerate(zip(new_rows, sources)) if src is None]
    if forks:  # shares the source's prefix: every layer's checkpoint, ring, cursor (no prefill)
        dev = engine.device
        engine.pool.fork(torch.tensor([s.slot for s, _ in forks], dtype=torch.int32, device=dev),
                         torch.tensor([r.slot for _, r in forks], dtype=torch.int32, device=dev))
        for s, r in forks:  # the oracle forks too
            if engine.lineage:
                engine.shadow[r.rid] = [t.clone() for t in engine.shadow[s.rid]]
                engine.shadow_win[r.rid] = [t.clone() for t in engine.shadow_win.get(s.rid, [])]
        engine.stats["forks"] += len(forks)
    if prefill:
        ids = [r.rid for _, r in prefill]
        pslots = slots[torch.tensor([i for i, _ in prefill], device=slots.device)]
        for l in range(engine.num_layers):  # prefill: random states of the rank's value heads
            g = torch.Generator().manual_seed(hash((args.seed, l, engine.rank, tuple(ids))) & 0x7FFFFFFF)
            states = torch.randn(len(ids), HV_l, V, K, generator=g).mul_(0.1)
            engine.pool.load_state(l, pslots, states.to(engine.device))
            if engine.lineage:
                for j, rid in enumerate(ids):
                    engine.shadow.setdefault(rid, []).append(states[j].double())
                    if args.conv_size:  # alloc zeroed the window
                        engine.shadow_win.setdefault(rid, []).append(torch.zeros(
                            engine.pool.conv_channels, args.conv_size - 1, dtype=torch.float64,
                            device=engine.device))
    engine.stats["admitted"] += len(new_rows)


def fork_sources(engine: Any, n: int) -> list[Request | None]:
    """For each of ``n`` new requests, the running request it forks from (a different one each), or None."""
    if engine.args.fork_prob <= 0:
        return [None] * n
    running = [r for r in engine.rows if r is not None]
    draws = torch.rand(n, generator=engine.life).tolist()
    picks = torch.randint(0, 1 << 30, (n,), generator=engine.life).tolist()
    out: list[Request | None] = []
    for d, pick in zip(draws, picks):
        if d < engine.args.fork_prob and running:
            out.append(running.pop(pick % len(running)))  # a slot is named once per fork call
        else:
            out.append(None)
    return out


def preempt(engine: Any) -> None:
    """Preempt some running requests: export each to CPU (asynchronously on CUDA), free its slot, queue it."""
    if engine.args.preempt_prob <= 0:
        return
    live = [i for i, r in enumerate(engine.rows) if r is not None]
    draws = torch.rand(len(live), generator=engine.life).tolist()
    for i, d in zip(live, draws):
        if d < engine.args.preempt_prob:
            r = engine.rows[i]
            shard = engine.pool.export_state([r.slot], device="cpu", non_blocking=engine.device.type == "cuda")
            engine.pool.free([r.slot])
            r.slot, r.cursor, r.resumed = -1, 0, True
            engine.waiting.append((r, shard))
            engine.rows[i] = None
            engine.stats["preempted"] += 1


def resume(engine: Any) -> None:
    """Preempted requests take empty rows first: a new slot each, ``import_state`` of their shard."""
    empty = [i for i, r in enumerate(engine.rows) if r is None]
    take = engine.waiting[: len(empty)]
    if not take:
        return
    del engine.waiting[: len(take)]
    slots = engine.pool.alloc(len(take))
    for j, (row, (r, shard)) in enumerate(zip(empty, take)):
        engine.pool.import_state(slots[j:j + 1], [shard])  # (waits for the export's copy)
        r.slot = int(slots[j])
        engine.rows[row] = r
    engine.stats["resumed"] += len(take)


def finish(engine: Any) -> None:
    """Requests with nothing left to decode free their slot (and their oracle states) and leave their row."""
    done = [i for i, r in enumerate(engine.rows) if r is not None and r.remaining == 0]
    if done:
        engine.pool.free([engine.rows[i].slot for i in done])
        for i in done:
            engine.shadow.pop(engine.rows[i].rid, None)
            engine.shadow_win.pop(engine.rows[i].rid, None)
            engine.rows[i] = None
        engine.stats["finished"] += len(done)
