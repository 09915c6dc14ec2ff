"""Requests, admission, forks and preemptions in the serving job (``launch/serve.py --fork-prob P
--preempt-prob P``).

A request's tokens are its ``prompt`` and its own greedy tokens, ``generated``. While it decodes, its slot's state
holds every token of ``prompt + generated`` but the last, :attr:`Request.last_token`: the next decode step's input.

**Admission** (:meth:`Lifecycle.admit`, every step before the model runs): free slots take preempted requests
first (oldest first, those that have sat out a step), then, one free slot at a time, a fork with chance
``--fork-prob`` or else the next waiting request of the stream (``pool.alloc``: zero state, empty ring, zero conv
window; its prompt is then prefilled).

**Fork** (``--fork-prob P``): a new request shares a decoding request's prefix at its current token. The source is
one of the decoding requests, a different one for each fork of a step; ``pool.fork(src, dst)`` makes the new slot a
byte copy of the source's (every layer's checkpoint, ring and conv window, and the cursor), so the fork needs no
prefill. The fork's prompt is the source's tokens at that moment, ``source.prompt + source.generated`` (its state
holds all of them but the last, which is its first decode input, exactly as for the source); its generated tokens
are its own, ``max_new`` of them drawn from ``--new-tokens``. Source and fork then continue independently. So a
fork is checked like every request: the reference model teacher-forced on its prompt (the shared prefix, the
source's generated tokens included) and its own tokens. A run makes at most ``--requests`` forks (so it ends).

**Preemption** (``--preempt-prob P``): after every step each active request (prefilling or decoding) is preempted
with chance ``P``: ``pool.export_state([slot])`` to the CPU (pinned and asynchronous on CUDA, ``non_blocking=True``:
the copy is ordered on the stream before anything that reuses the slot), ``pool.free``, and it waits with its
``StateShard``. The next step runs without it (its slot may go to a fork or a waiting request); from the
admission after that on it is resumed as soon as a slot is free, ahead of forks and new requests: ``pool.alloc`` and
``pool.import_state(slot, shard)`` (the checkpoint is the exported state, the ring empty, the cursor 0; the import
waits for the copy), and it continues where it stopped: the rest of its prompt's prefill, or its decode. The
import materializes the ring, which changes only the order of fp32 sums (with a bf16 cache also the rounding of the
ring entries: docs/lifecycle.md, "Rounding of a materialized ring"), so its greedy tokens are those of an
uninterrupted run up to near ties, which the reference check reports.

**Lockstep**: every decision draws from one generator seeded from ``--seed``, and what it draws depends only on host
state that every rank has the same (the active and preempted requests, the free slots), so every rank forks,
preempts and resumes the same requests in the same order and the model's collectives stay paired.

**The stream is unchanged**: its prompts and lengths come from their own generator, and greedy tokens depend only on
a request's own tokens, so the stream's requests (ids ``< --requests``) generate the same tokens with or without
the options (the summary's checksum of the stream's requests; forks have ids from ``--requests`` on).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import torch

__all__ = ["Lifecycle", "Request"]


@dataclasses.dataclass
class Request:
    """One request: ``rid`` (stream requests ``0..N-1``, forks from ``N``), ``prompt``, ``max_new`` tokens to
    generate; its ``slot`` (-1: none, preempted or not admitted), ``prefilled`` prompt tokens in the slot's state,
    ``generated`` tokens and, on rank 0, their fp32 logits; ``parent`` (a fork's source, else -1) and
    ``preemptions``."""

    rid: int
    prompt: list[int]
    max_new: int
    slot: int = -1
    prefilled: int = 0  # prompt tokens in the slot's state (a fork: all of them, the last one pending)
    generated: list[int] = dataclasses.field(default_factory=list)
    logits: list[Any] = dataclasses.field(default_factory=list)  # rank 0: fp32 [vocab] per generated token
    parent: int = -1
    preemptions: int = 0

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt) and len(self.generated) < self.max_new

    @property
    def last_token(self) -> int:
        """The next decode step's input: the last token, the one token not yet in the slot's state."""
        return self.generated[-1] if self.generated else self.prompt[-1]


class Lifecycle:
    """One rank's admissions, forks, preemptions and resumptions over ``pool`` (module docstring). ``args``: the
    job's options (``fork_prob``, ``preempt_prob``, ``requests``, ``new_tokens``, ``seed``)."""

    def __init__(self, args: Any, pool: Any, device: torch.device) -> None:
        self.pool, self.device = pool, device
        self.fork_prob, self.preempt_prob = float(args.fork_prob), float(args.preempt_prob)
        self.max_forks, self.new_tokens = int(args.requests), tuple(args.new_tokens)
        self.rng = torch.Generator().manual_seed(args.seed * 7177 + 3)  # the same draws on every rank
        self.next_rid = int(args.requests)  # forks' ids follow the stream's
        self.preempted: collections.deque[tuple[Request, Any, int]] = collections.deque()  # request, shard, step
        self.step = 0  # admissions so far
        self.stats = dict(forks=0, preemptions=0, resumptions=0, fork_s=0.0, export_s=0.0, import_s=0.0)

    @property
    def enabled(self) -> bool:
        return self.fork_prob > 0 or self.preempt_prob > 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def admit(self, active: list[Request], waiting: collections.deque[Request]) -> list[Request]:
        """Fill free slots: preempted requests first, then per free slot a fork (chance ``fork_prob``, a decoding
        request of ``active`` or a resumed one as its source, each source once) or the next request of ``waiting``
        (taken off it). Returns the admitted requests, in slot order within each kind."""
        self.step += 1
        admitted = self._resume()
        sources = [r for r in active + admitted if r.decoding]
        plan: list[tuple[bool, Request]] = []  # per new slot: (True, a fork's source) or (False, a stream request)
        forks = 0
        for _ in range(self.pool.num_free):
            if self.fork_prob > 0 and sources and self.stats["forks"] + forks < self.max_forks:
                draw = torch.rand((), generator=self.rng).item()
                pick = int(torch.randint(0, 1 << 30, (), generator=self.rng))
                if draw < self.fork_prob:
                    plan.append((True, sources.pop(pick % len(sources))))
                    forks += 1
                    continue
            if not waiting:
                break
            plan.append((False, waiting.popleft()))
        if not plan:
            return admitted
        slots = self.pool.alloc(len(plan)).tolist()
        pairs: list[tuple[int, int]] = []
        for (is_fork, item), slot in zip(plan, slots):
            if is_fork:  # item: the source
                prefix = item.prompt + item.generated
                new = Request(self.next_rid, prefix, self._fork_length(), slot=slot, prefilled=len(prefix),
                              parent=item.rid)
                self.next_rid += 1
                pairs.append((item.slot, slot))
                admitted.append(new)
            else:
                item.slot = slot
                admitted.append(item)
        if pairs:
            self._sync()
            t0 = time.perf_counter()
            self.pool.fork(torch.tensor([s for s, _ in pairs], dtype=torch.int32, device=self.device),
                           torch.tensor([d for _, d in pairs], dtype=torch.int32, device=self.device))
            self._sync()
            self.stats["fork_s"] += time.perf_counter() - t0
            self.stats["forks"] += len(pairs)
        return admitted

    def _fork_length(self) -> int:
        lo, hi = self.new_tokens
        return int(torch.randint(lo, hi + 1, (), generator=self.rng))

    def _resume(self) -> list[Request]:
        """Preempted requests that have sat out a step, oldest first, into new slots: ``pool.alloc``,
        ``pool.import_state`` of each shard."""
        ready = sum(1 for _, _, step in self.preempted if step < self.step - 1)  # the oldest come first
        n = min(self.pool.num_free, ready)
        if not n:
            return []
        take = [self.preempted.popleft()[:2] for _ in range(n)]
        slots = self.pool.alloc(n)
        t0 = time.perf_counter()
        for j, (r, shard) in enumerate(take):
            self.pool.import_state(slots[j:j + 1], [shard])  # (waits for an asynchronous export's copy)
            r.slot = int(slots[j])
        self._sync()
        self.stats["import_s"] += time.perf_counter() - t0
        self.stats["resumptions"] += n
        return [r for r, _ in take]

    def preempt(self, active: list[Request]) -> list[Request]:
        """Preempt each request of ``active`` with chance ``preempt_prob``: export its state to the CPU
        (asynchronously on CUDA), free its slot, queue it. Returns the requests that stay active."""
        if self.preempt_prob <= 0 or not active:
            return active
        draws = torch.rand(len(active), generator=self.rng).tolist()
        keep = []
        t0 = time.perf_counter()
        for r, d in zip(active, draws):
            if d >= self.preempt_prob:
                keep.append(r)
                continue
            shard = self.pool.export_state([r.slot], device="cpu", non_blocking=self.device.type == "cuda")
            self.pool.free([r.slot])
            r.slot = -1
            r.preemptions += 1
            self.preempted.append((r, shard, self.step))
            self.stats["preemptions"] += 1
        self.stats["export_s"] += time.perf_counter() - t0
        return keep

    def summary(self, finished: list[Request]) -> str:
        """The summary's line: forks (and the tokens the forks generated), preemptions (and of how many of the
        ``finished`` requests) and resumptions, and the time of the pool's fork, export and import calls."""
        s = self.stats
        fork_tokens = sum(len(r.generated) for r in finished if r.parent >= 0)
        hit = sum(r.preemptions > 0 for r in finished)
        return (f"  lifecycle: forks {s['forks']} (--fork-prob {self.fork_prob}; they generated {fork_tokens} "
                f"tokens), preemptions {s['preemptions']} of {hit} requests, resumptions {s['resumptions']} "
                f"(--preempt-prob {self.preempt_prob}); pool.fork {s['fork_s'] * 1e3:.1f} ms, export_state "
                f"{s['export_s'] * 1e3:.1f} ms, import_state {s['import_s'] * 1e3:.1f} ms in all")
