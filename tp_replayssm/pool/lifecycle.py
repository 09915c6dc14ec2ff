"""A request's life in the pool beyond decoding: ``alloc``, ``free``, ``fork``, ``export_state``, ``import_state``.

- :func:`alloc` hands out slots from the host free list and zeroes their state (device ops, no sync; while a
  verify step is open, free slots that it names wait for its commit); :func:`free`
  gives them back and marks their cursors free, so the kernels refuse rows that name them; a slot of the open
  verify step is refused until its commit.
- :func:`fork` makes slots copies of others (a request that shares another's prefix): every layer's checkpoint,
  ring (d/k/g), the cursor and the conv window of ``dst`` become those of ``src``, byte for byte, so ``read_state``
  and every later decode of ``dst`` equal ``src``'s until their inputs differ. Where kernels run
  (:mod:`tp_replayssm.kernels.backend`) it is one launch of the Helion kernel of :mod:`tp_replayssm.kernels.fork`;
  on CPU tensors (and for a pool whose slot blocks are not whole int32 words) :func:`fork_torch`, one gather and
  one scatter per pool tensor. No host sync either way, CUDA-graph capturable. A pair is a padding pair when
  ``dst < 0``; any other pair whose ``src`` or ``dst`` is out of range or not allocated, whose ``dst`` is another
  pair's ``dst`` or any pair's ``src`` (``dst == src`` included), or whose ``src`` is a pair's ``dst``, is refused
  with no byte of any slot changed, and recorded for ``pool.check()`` under method ``fork``. One source may feed
  several pairs (one prefix forked into several requests in one call).
- :func:`export_state` materializes the slots' state (checkpoint plus replayed ring, fp32, every layer) and conv
  windows into a :class:`~tp_replayssm.pool.shard.StateShard`, on the CPU (pinned, optionally asynchronous) or any
  device. It changes nothing.
- :func:`import_state` sets slots from shards of any tensor-parallel size that together cover this rank's heads:
  checkpoints (cast to the state dtype), conv windows (cast to the conv dtype), empty rings, cursors 0. Everything
  is validated before the first write.

Export and import synchronize with the device anyway, so both first report earlier bad calls (``pool.check()``)
and check their own slot ids on the host (:class:`~tp_replayssm.errors.SlotError`), as ``read_state`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from ..kernels import fork as fork_kernels
from ..kernels.backend import runs_kernel
from ..kernels.guard import FREE_CURSOR, SlotGuard, record_bad_rows
from ..reference import replay_predecayed_ring, replay_ring
from ..tp.devices import resolve_device
from ..validation import describe
from .agreement import same_call_on_every_rank, slot_ids
from .shard import StateShard
from .slots import host_ids, ids_on_device, in_flight, raise_slot_error, refuse_bad_ids, waiting

if TYPE_CHECKING:
    from .pool import ReplaySSMStatePool

__all__ = ["alloc", "export_state", "fork", "fork_torch", "free", "import_state", "materialize", "pair_verdict"]


def alloc(pool: ReplaySSMStatePool, n: int) -> torch.Tensor:
    """:meth:`ReplaySSMStatePool.alloc`."""
    # a free slot that the open verify step names (a refused row) is not handed out before the commit, which would
    # otherwise write the step into the new request's cursor and conv window (reads the step's slots back: a sync,
    # only while a step is open)
    held = in_flight(pool)
    if pool.debug:  # the ranks' free lists must hand out the same ids
        same_call_on_every_rank(pool, "ReplaySSMStatePool.alloc", n=n, ids=pool._slots.peek(n, held))
    ids = pool._slots.take(n, "ReplaySSMStatePool.alloc", held)
    out = ids_on_device(ids, torch.int32, pool.device)
    if n:
        idx = out.long()
        for t in (pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache, pool.conv_state,
                  getattr(pool, "spec_folded", None)):  # (spec_folded: pool/spec.py)
            if t is not None:
                t.index_fill_(1, idx, 0)
        pool.cursors.index_fill_(0, idx, 0)
    return out


def free(pool: ReplaySSMStatePool, slots: object) -> None:
    """:meth:`ReplaySSMStatePool.free`."""
    where = "ReplaySSMStatePool.free"
    if pool.debug:  # first, before any check that may raise on one rank alone (docs/contract.md)
        same_call_on_every_rank(pool, where, slots=slots)
    ids = host_ids(slots, where)
    # a slot of the open verify step stays until its commit: freed and handed out again, it would take the old step's
    # commit (cursor, conv window) into the new request's state (reads the step's slots back: a sync, only while open)
    raise_slot_error(where, waiting(pool, ids))
    pool._slots.give_back(ids, where)
    if ids:  # the kernels now refuse rows that name these slots
        pool.cursors.index_fill_(0, ids_on_device(ids, torch.long, pool.device), FREE_CURSOR)

# the most fp32 state bytes materialized on the pool's device at once by an export (layers are done in chunks)
EXPORT_CHUNK_BYTES = 256 << 20


# ---- fork ---------------------------------------------------------------------------------------------------------


def pair_verdict(pool: ReplaySSMStatePool, src: torch.Tensor, dst: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ok, bad, shown)`` of fork pairs ``src, dst [n]``: ``ok`` the pairs that copy, ``bad`` the refused pairs
    (``dst >= 0`` but not ``ok``), ``shown`` the slot a refused pair is recorded with (its ``src`` when the source is
    at fault, else its ``dst``). A pair copies when both slots are in range and allocated, its ``dst`` is the ``dst``
    of no other pair and the ``src`` of none, and its ``src`` is no pair's ``dst`` (a source may feed several pairs:
    it is only read). A padding pair (``dst < 0``) names no slot. Torch ops, no host sync."""
    S, L = pool.num_slots, pool.ring_length
    pair = dst >= 0
    s_in, d_in = (src >= 0) & (src < S), (dst >= 0) & (dst < S)
    s_idx, d_idx = torch.where(s_in, src, S).long(), torch.where(d_in, dst, S).long()
    as_dst = torch.zeros(S + 1, dtype=torch.int32, device=src.device).index_add_(0, d_idx, d_in.int())
    as_src = torch.zeros(S + 1, dtype=torch.int32, device=src.device).index_add_(0, s_idx, (s_in & pair).int())
    cur_s, cur_d = pool.cursors.index_select(0, s_idx), pool.cursors.index_select(0, d_idx)
    src_ok = s_in & (cur_s >= 0) & (cur_s < L) & (as_dst.index_select(0, s_idx) == 0)
    dst_ok = d_in & (cur_d >= 0) & (cur_d < L) & (as_dst.index_select(0, d_idx) == 1) \
        & (as_src.index_select(0, d_idx) == 0)
    ok = src_ok & dst_ok & pair
    return ok, pair & ~ok, torch.where(src_ok, dst, src)


def fork(pool: ReplaySSMStatePool, src: torch.Tensor, dst: torch.Tensor) -> None:
    """:meth:`ReplaySSMStatePool.fork`: argument checks (debug mode: the pairs on the host), then one launch of the
    fork kernel where kernels run, else :func:`fork_torch` (module docstring)."""
    where = "ReplaySSMStatePool.fork"
    if pool.debug:  # first, before any check that may raise on one rank alone (docs/contract.md)
        same_call_on_every_rank(pool, where, src=src, dst=slot_ids(dst))
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32 or t.device != pool.device:
            raise ValueError(f"{where}: `{name}` must be a 1-D torch.int32 tensor on {pool.device}; got {describe(t)}")
    if src.shape != dst.shape:
        raise ValueError(f"{where}: `src` and `dst` must have the same length; got {describe(src)} and "
                         f"{describe(dst)}")
    if pool.debug:
        _debug_check_pairs(pool, src, dst, where)
    if src.shape[0] == 0:
        return
    guard = pool.guard("fork")
    step = getattr(pool, "_spec_step", None)
    if step is not None:  # pairs naming a slot of the open verify step wait for its commit: refused and recorded
        dst = _refuse_in_flight(src, dst, step.slots, guard)
    if runs_kernel(pool.device, where):
        words = fork_kernels.pool_words(pool)
        if words is not None:
            fork_kernels.launch_fork(pool, words, src, dst, guard)
            return
    fork_torch(pool, src, dst, guard)


def _refuse_in_flight(src: torch.Tensor, dst: torch.Tensor, busy: torch.Tensor, guard: SlotGuard) -> torch.Tensor:
    """``dst`` with the pairs that name a slot of ``busy`` (the open verify step's slots, ``-1`` padding) turned into
    padding pairs, which copy nothing, and those pairs recorded as bad rows (the slot shown: the source when it is
    busy, else the destination). Torch ops, no host sync; runs only while a step is open."""
    live = busy[None, :] >= 0
    src_busy = ((src[:, None] == busy[None, :]) & live).any(1)
    bad = (src_busy | ((dst[:, None] == busy[None, :]) & live).any(1)) & (dst >= 0)
    record_bad_rows(guard.errors, guard.code, bad, torch.where(src_busy, src, dst))
    return torch.where(bad, -1, dst)


def fork_torch(pool: ReplaySSMStatePool, src: torch.Tensor, dst: torch.Tensor, guard: SlotGuard) -> None:
    """The fork of validated pairs ``src, dst [n]`` (``n >= 1``) as torch ops, the reference for the kernel: the
    pairs' verdict, one gather and one scatter per pool tensor, the record of refused pairs in ``guard``. No host
    sync."""
    ok, bad, shown = pair_verdict(pool, src, dst)
    # Refused and padding pairs copy one slot onto itself: the first good pair's source (no good pair writes it:
    # a good pair's destination is no pair's source), or slot 0 when no pair is good. Every such write puts back
    # the bytes just read, so the scatter's repeated indices all carry the same values and nothing changes.
    src_l = src.long()
    first = src_l.index_select(0, ok.int().argmax().reshape(1))  # (a 0-d index would sync)
    spare = torch.where(ok.any(), first, 0)
    from_idx = torch.where(ok, src_l, spare)
    to_idx = torch.where(ok, dst.long(), spare)
    for t in (pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache, pool.conv_state):
        if t is not None:
            t.index_copy_(1, to_idx, t.index_select(1, from_idx))
    pool.cursors.index_copy_(0, to_idx, pool.cursors.index_select(0, from_idx))
    record_bad_rows(guard.errors, guard.code, bad, shown)


def _debug_check_pairs(pool: ReplaySSMStatePool, src: torch.Tensor, dst: torch.Tensor, where: str) -> None:
    """Debug mode (host sync): every non-padding pair's slots in range and allocated, each ``dst`` named once in the
    call and never as a ``src`` (a ``src`` may feed several pairs)."""
    pairs = [(s, d) for s, d in zip(src.tolist(), dst.tolist()) if d >= 0]
    where = f"{where} (pairs {pairs})"
    pool._debug_check(torch.tensor([s for s, _ in pairs], dtype=torch.int32), where, allow_padding=False,
                      unique=False)
    pool._debug_check(torch.tensor([d for _, d in pairs], dtype=torch.int32), where, allow_padding=False,
                      unique=True)
    both = sorted({d for _, d in pairs} & {s for s, _ in pairs})
    raise_slot_error(f"{where} (debug check)", [f"slots named as a source and as a destination: {both}"] if both
                     else [])


# ---- export -------------------------------------------------------------------------------------------------------


def _host_slots(pool: ReplaySSMStatePool, slots: object, where: str, *, unique: bool) -> list[int]:
    """The slot ids of an export or import, checked on the host after ``pool.check()``: a 1-D integer tensor on the
    pool's device or a sequence of ints, each allocated, not in the open verify step (an export would read its
    drafts' fold, an import race the commit) and, for a write, named once."""
    if isinstance(slots, torch.Tensor) and slots.device != pool.device:
        raise ValueError(f"{where}: `slots` must be on {pool.device} (or a list of ints); got {describe(slots)}")
    ids = host_ids(slots, where)
    pool.check()
    refuse_bad_ids(pool, ids, where, unique=unique)
    return ids


def materialize(pool: ReplaySSMStatePool, idx: torch.Tensor, layers: range) -> torch.Tensor:
    """The true state ``[len(layers), n, HV_l, V, K]`` fp32 of slots ``idx [n]`` (long, on the pool's device) in
    ``layers``: the checkpoint plus the ring entries ``j < cursor`` replayed in the pool's layout (what
    ``read_state`` computes, for all those layers in one batch)."""
    sel = slice(layers.start, layers.stop)
    S0, d, k, g = (t[sel].index_select(1, idx).flatten(0, 1)
                   for t in (pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache))
    cursor = pool.cursors.index_select(0, idx).repeat(len(layers))  # [layers * n], layer-major like the flatten
    if pool.predecayed:
        out = replay_predecayed_ring(S0, d, k, g, cursor)
    else:
        out = replay_ring(S0, d, k.repeat_interleave(pool.local_heads.group, dim=1), g, cursor)
    return out.view(len(layers), idx.shape[0], *out.shape[1:])


def export_state(pool: ReplaySSMStatePool, slots: object, device: torch.device | str | None,
                 non_blocking: bool) -> StateShard:
    """:meth:`ReplaySSMStatePool.export_state` (module docstring)."""
    where = "ReplaySSMStatePool.export_state"
    if pool.debug:  # first, before any check that may raise on one rank alone (docs/contract.md)
        same_call_on_every_rank(pool, where, slots=slots)
    # a CUDA device on a machine without CUDA (or past the visible ones) is a ValueError that says so
    target = pool.device if device is None else resolve_device(device, where)
    ids = _host_slots(pool, slots, where, unique=False)
    n, NL, dev = len(ids), pool.num_layers, pool.device
    loc, shard = pool.local_heads, pool.shard
    HV, V, K = loc.num_v_heads, loc.value_dim, loc.key_dim
    idx = torch.tensor(ids, dtype=torch.long, device=dev)
    pinned = target.type == "cpu" and dev.type == "cuda"  # the device -> host copy runs from pinned memory
    states = torch.empty(NL, n, HV, V, K, dtype=torch.float32, device=target, pin_memory=pinned)
    per_layer = max(1, n * HV * V * K * 4)
    step = max(1, EXPORT_CHUNK_BYTES // per_layer)
    for start in range(0, NL, step):
        part = range(start, min(NL, start + step))
        states[part.start:part.stop].copy_(materialize(pool, idx, part), non_blocking=non_blocking)
    conv_states = None
    if pool.conv_state is not None:
        window = pool.conv_state.index_select(1, idx)
        conv_states = torch.empty(window.shape, dtype=window.dtype, device=target, pin_memory=pinned)
        conv_states.copy_(window, non_blocking=non_blocking)
    copy_done = None
    if non_blocking and dev.type == "cuda" and target != dev:
        copy_done = torch.cuda.Event()
        copy_done.record(torch.cuda.current_stream(dev))
    return StateShard(
        heads=pool.heads, tp_rank=pool.tp_rank, tp_size=pool.tp_size, v_head_start=shard.v_head_start,
        v_head_end=shard.v_head_end, q_head_start=shard.q_head_start, q_head_end=shard.q_head_end,
        num_layers=NL, ring_length=pool.ring_length, ring_layout=pool.ring_layout, state_dtype=pool.state_dtype,
        cache_dtype=pool.cache_dtype, conv_kernel_size=pool.conv_kernel_size,
        conv_dtype=pool.conv_dtype if pool.conv_kernel_size else None, conv_q_channels=K, conv_k_channels=K,
        conv_v_channels=V, source_slots=tuple(ids), states=states, conv_states=conv_states, copy_done=copy_done)


# ---- import -------------------------------------------------------------------------------------------------------


# what the ranks of one source pool share (its fingerprint's fields a shard carries)
SOURCE_POOL_FIELDS = ("tp_size", "ring_length", "ring_layout", "state_dtype", "cache_dtype", "conv_dtype")


def import_state(pool: ReplaySSMStatePool, slots: object, shards: Iterable[StateShard]) -> None:
    """:meth:`ReplaySSMStatePool.import_state` (module docstring): validate everything, assemble this rank's heads
    from the shards on the pool's device, then write."""
    where = "ReplaySSMStatePool.import_state"
    if isinstance(shards, StateShard):
        shards = [shards]
    if pool.debug:  # first, before any check that may raise on one rank alone (docs/contract.md)
        first = next(iter(shards), None) if isinstance(shards, (list, tuple)) else None
        same_call_on_every_rank(pool, where, slots=slots,
                                source_slots=list(first.source_slots) if isinstance(first, StateShard) else None)
    if not isinstance(shards, Iterable) or isinstance(shards, Mapping):
        raise ValueError(f"{where}: `shards` must be a StateShard or an iterable of StateShard (a dict's: pass its "
                         f"values()); got {type(shards).__name__}")
    shards = list(shards)
    if not shards:
        raise ValueError(f"{where}: `shards` is empty; it must cover this pool's heads ({_pool_text(pool)})")
    for i, s in enumerate(shards):
        if not isinstance(s, StateShard):
            raise ValueError(f"{where}: `shards[{i}]` must be a StateShard; got {type(s).__name__}")
    ids = _host_slots(pool, slots, where, unique=True)
    for i, s in enumerate(shards):
        _check_shard(pool, s, i, len(ids), where)
        if s.source_slots != shards[0].source_slots:  # one request's heads must not come from another's slot
            raise ValueError(f"{where}: shards[{i}] holds source slots {list(s.source_slots)} but shards[0] holds "
                             f"{list(shards[0].source_slots)}: the shards of one import hold the same requests in the "
                             f"same order (the ranks of a group name a request by one slot)")
        source = [(name, getattr(s, name), getattr(shards[0], name)) for name in SOURCE_POOL_FIELDS]
        differ = [f"{name} {mine} (shards[0]: {first})" for name, mine, first in source if mine != first]
        if differ:  # one export's shards: the same source pool on every rank
            raise ValueError(f"{where}: shards[{i}] comes from another pool than shards[0]: {', '.join(differ)}; the "
                             f"shards of one import are one export's (every rank of the source pool's group)")
    v_src = _cover(pool, shards, "v", where)
    q_src = _cover(pool, shards, "q", where) if pool.conv_state is not None else []
    for s in shards:
        s.wait()
    if not ids:
        return
    dev, shard = pool.device, pool.shard
    # this rank's value heads, run by run (consecutive heads from one shard), on the pool's device
    states = _cat([_on(pool, shards[i].states, (slice(None), slice(None),
                                                 slice(a - shards[i].v_head_start, b - shards[i].v_head_start)))
                   for i, a, b in _runs(shard.v_heads, v_src)])
    windows = None
    if pool.conv_state is not None:  # q block, k block, v block of this rank's channels
        moved = {i: _on(pool, shards[i].conv_states, ()) for i in sorted(set(q_src) | set(v_src))}
        pieces = []
        for kind, heads, src in (("q", shard.q_heads, q_src), ("k", shard.q_heads, q_src),
                                 ("v", shard.v_heads, v_src)):
            for i, a, b in _runs(heads, src):
                cols = slice(shards[i].conv_columns(kind, a).start, shards[i].conv_columns(kind, b - 1).stop)
                pieces.append(moved[i][:, :, cols])
        windows = _cat(pieces)
    idx = torch.tensor(ids, dtype=torch.long, device=dev)
    pool.checkpoint.index_copy_(1, idx, states.to(pool.state_dtype))
    for ring in (pool.d_cache, pool.k_cache, pool.g_cache):
        ring.index_fill_(1, idx, 0)
    pool.cursors.index_fill_(0, idx, 0)
    if windows is not None:
        pool.conv_state.index_copy_(1, idx, windows.to(pool.conv_dtype))


def _runs(heads: range, src: list[int]) -> list[tuple[int, int, int]]:
    """``(shard index, first head, end head)`` of each run of consecutive heads taken from one shard."""
    runs: list[tuple[int, int, int]] = []
    for h, i in zip(heads, src):
        if runs and runs[-1][0] == i and runs[-1][2] == h:
            runs[-1] = (i, runs[-1][1], h + 1)
        else:
            runs.append((i, h, h + 1))
    return runs


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces joined along the head / channel axis (a single piece as it is)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)


def _on(pool: ReplaySSMStatePool, t: torch.Tensor, index: tuple) -> torch.Tensor:
    """``t[index]`` on the pool's device. A whole tensor moves as it is (asynchronously from pinned memory); a part
    is cut where it lies first, so only the needed bytes travel."""
    part = t[index]
    if part.device != pool.device and not part.is_contiguous():
        part = part.contiguous()
    return part.to(pool.device, non_blocking=True)


def _pool_text(pool: ReplaySSMStatePool) -> str:
    sh = pool.shard
    return (f"rank {pool.tp_rank}/{pool.tp_size} of heads {pool.heads}, {pool.num_layers} layers, value heads "
            f"[{sh.v_head_start}, {sh.v_head_end}), q/k heads [{sh.q_head_start}, {sh.q_head_end}), "
            f"conv_kernel_size {pool.conv_kernel_size}")


def _check_shard(pool: ReplaySSMStatePool, s: StateShard, i: int, n: int, where: str) -> None:
    """One shard against the importing pool and against its own ranges (ValueError naming both sides)."""
    loc = pool.local_heads
    K, V = loc.key_dim, loc.value_dim
    pairs = [("heads", s.heads, pool.heads), ("num_layers", s.num_layers, pool.num_layers),
             ("requests (len(slots))", s.num_requests, n), ("conv_kernel_size", s.conv_kernel_size,
                                                           pool.conv_kernel_size)]
    if pool.conv_kernel_size:
        pairs += [("conv channels per head (q, k, v)", (s.conv_q_channels, s.conv_k_channels, s.conv_v_channels),
                   (K, K, V))]
    for name, theirs, ours in pairs:
        if theirs != ours:
            raise ValueError(f"{where}: shards[{i}] does not match this pool: {name} {theirs} (shard: "
                             f"{s.describe()}) vs {ours} (pool: {_pool_text(pool)})")
    HV_s = s.v_head_end - s.v_head_start
    if not (0 <= s.v_head_start < s.v_head_end <= s.heads.num_v_heads
            and 0 <= s.q_head_start < s.q_head_end <= s.heads.num_q_heads):
        raise ValueError(f"{where}: shards[{i}] has head ranges outside its heads: {s.describe()}")
    want = (s.num_layers, n, HV_s, V, K)
    if not isinstance(s.states, torch.Tensor) or tuple(s.states.shape) != want or s.states.dtype != torch.float32:
        raise ValueError(f"{where}: shards[{i}].states must be a float32 tensor [layers, n, HV_s, V, K] = "
                         f"{list(want)} ({s.describe()}); got {describe(s.states)}")
    if s.conv_kernel_size:
        want = (s.num_layers, n, s.conv_channels, s.conv_kernel_size - 1)
        c = s.conv_states
        if not isinstance(c, torch.Tensor) or tuple(c.shape) != want or not c.dtype.is_floating_point:
            raise ValueError(f"{where}: shards[{i}].conv_states must be a floating tensor [layers, n, D_s, W-1] = "
                             f"{list(want)} ({s.describe()}); got {describe(c)}")


def _cover(pool: ReplaySSMStatePool, shards: list[StateShard], kind: str, where: str) -> list[int]:
    """For each of this rank's value heads (``kind`` "v") or q/k heads ("q"), the first shard that holds it
    (ValueError naming the missing heads and every shard's range)."""
    mine = pool.shard.v_heads if kind == "v" else pool.shard.q_heads
    found = []
    for h in mine:
        holder = next((i for i, s in enumerate(shards) if h in (s.v_heads if kind == "v" else s.q_heads)), None)
        found.append(holder)
    missing = [h for h, i in zip(mine, found) if i is None]
    if missing:
        what = "value heads" if kind == "v" else "q/k heads (conv channels)"
        have = ", ".join(f"[{r.start}, {r.stop})" for r in (s.v_heads if kind == "v" else s.q_heads for s in shards))
        raise ValueError(f"{where}: the shards do not cover this pool's {what} [{mine.start}, {mine.stop}) "
                         f"(pool: {_pool_text(pool)}): missing {missing}; the shards hold {have}")
    return found  # type: ignore[return-value]
