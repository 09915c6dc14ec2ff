"""The pool's slot bookkeeping: a host-side free list, and the checks of slot-id arguments.

:class:`SlotTable` hands out and takes back slot ids on the host, with no device sync (like vLLM's block pool). The
functions below check slot-id tensors by metadata (no sync) and, in debug mode, by value (a host sync). What the
device does with bad slot ids is :mod:`tp_replayssm.kernels.guard`.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import PoolExhaustedError, SlotError
from ..validation import describe

if TYPE_CHECKING:
    from .pool import ReplaySSMStatePool

__all__ = ["SlotTable", "check_ids", "debug_check", "in_flight", "is_int", "refuse_bad_ids", "waiting"]


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SlotTable:
    """Host-side free list of ``num_slots`` slot ids, first in, first out: the ids start in order (``0`` first) and
    a freed id goes to the back, so the ids freed longest ago are handed out first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: collections.deque[int] = collections.deque(range(num_slots))
        self._allocated = bytearray(num_slots)  # 1 = handed out

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and bool(self._allocated[slot])

    def allocated(self) -> list[int]:
        return [i for i in range(self.num_slots) if self._allocated[i]]

    def diagnose(self, method: str, shown: list[int]) -> str | None:
        """Why the slots ``shown`` (a recorded bad call's, in row order) were refused, as far as the host can tell at
        ``check()`` time: out of range, named twice among the rows shown, not allocated now, or (allocated now) free
        at the call or named again in a row not shown (verify and commit: or the row's parents, num_accepted or path
        not valid). A fork's shown slot may be its pair's source or destination: only range and allocation are
        told there. None when nothing is shown."""
        count = collections.Counter(shown)
        reasons: dict[str, list[int]] = {}
        for slot in dict.fromkeys(shown):
            if not 0 <= slot < self.num_slots:
                why = f"out of range [0, {self.num_slots})"
            elif count[slot] > 1 and method != "fork":
                why = "named twice in the call"
            elif not self._allocated[slot]:
                why = "not allocated now"
            elif method in ("verify", "commit"):
                why = "allocated now (free at the call, named again in a row not shown, or the row's drafts not valid)"
            elif method == "fork":
                continue
            else:
                why = "allocated now (free at the call, or named again in a row not shown)"
            reasons.setdefault(why, []).append(slot)
        if not reasons:
            return None
        return "; ".join(f"slot{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}: {why}"
                         for why, ids in reasons.items())

    def peek(self, n: object, held: Collection[int] = ()) -> list[int]:
        """The ids ``take(n, where, held)`` would hand out now (as many as are free), taking none."""
        if not is_int(n) or n <= 0:
            return []
        return list(itertools.islice((i for i in self._free if i not in held), n))

    def take(self, n: int, where: str, held: Collection[int] = ()) -> list[int]:
        """``n`` free ids, skipping those in ``held`` (free ids that must not be handed out yet: they keep their
        place at the front); ``PoolExhaustedError``, taking none, when fewer are free."""
        if not is_int(n) or n < 0:
            raise ValueError(f"{where}: `n` must be a non-negative int; got {n!r}")
        held_free = sum(1 for i in self._free if i in held) if held else 0
        if n > len(self._free) - held_free:
            raise PoolExhaustedError(
                f"{where}: asked for {n} slots but only {len(self._free) - held_free} of {self.num_slots} are free"
                + (f" ({held_free} more free slots are named by the open verify step: handed out after its commit)"
                   if held_free else ""))
        ids: list[int] = []
        kept: list[int] = []
        while len(ids) < n:
            i = self._free.popleft()
            (kept if i in held else ids).append(i)
        self._free.extendleft(reversed(kept))
        for i in ids:
            self._allocated[i] = 1
        return ids

    def give_back(self, ids: list[int], where: str) -> None:
        """Free ``ids``: an id out of range, not handed out (a double free) or given twice raises ``ValueError``
        and frees nothing."""
        seen: set[int] = set()
        bad_range, not_alloc, dup = [], [], []
        for i in ids:
            if not 0 <= i < self.num_slots:
                bad_range.append(i)
            elif i in seen:
                dup.append(i)
            elif not self._allocated[i]:
                not_alloc.append(i)
            seen.add(i)
        if bad_range or not_alloc or dup:
            parts = []
            if bad_range:
                parts.append(f"ids out of range [0, {self.num_slots}): {bad_range}")
            if not_alloc:
                parts.append(f"ids not allocated (double free or never handed out): {not_alloc}")
            if dup:
                parts.append(f"ids given more than once: {dup}")
            raise ValueError(f"{where}: nothing freed; `slots` holds {'; '.join(parts)}")
        for i in ids:
            self._allocated[i] = 0
            self._free.append(i)

    def problems(self, ids: Sequence[int], *, allow_padding: bool, unique: bool) -> list[str]:
        """What is wrong with these ids by value (the debug checks): out of range or not allocated, repeated."""
        live = [i for i in ids if i >= 0] if allow_padding else list(ids)
        problems = []
        bad = [i for i in live if not self.is_allocated(i)]
        if bad:
            problems.append(f"slots out of range [0, {self.num_slots}) or not allocated: {bad}")
        if unique:
            dups = sorted({i for i in live if live.count(i) > 1})
            if dups:
                problems.append(f"slots given more than once in one call: {dups}")
        return problems


def check_ids(slots: object, where: str, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """A slot-id argument must be a 1-D tensor of one of ``dtypes`` on ``device`` (metadata only, no sync)."""
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in dtypes or slots.device != device:
        names = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{where}: `slots` must be a 1-D {names} tensor on {device}; got {describe(slots)}")
    return slots


def host_ids(slots: object, where: str) -> list[int]:
    """Slot ids given as an int, a sequence of ints or a 0-/1-D integer tensor, as a list (a CUDA tensor is read
    back to the host)."""
    if is_int(slots):
        return [slots]
    if isinstance(slots, torch.Tensor):
        if slots.dim() > 1 or slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
            raise ValueError(f"{where}: `slots` must be an int, a sequence of ints or a 0-/1-D integer tensor; got "
                             f"{describe(slots)}")
        return [int(i) for i in slots.reshape(-1).tolist()]
    if isinstance(slots, Iterable) and not isinstance(slots, (str, bytes)):
        ids = list(slots)
        if all(is_int(i) for i in ids):
            return ids
    raise ValueError(f"{where}: `slots` must be an int, a sequence of ints or a 0-/1-D integer tensor; got {slots!r}")


def ids_on_device(ids: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host ids as a tensor on ``device`` without a host sync. ``torch.tensor(ids, device=cuda)`` is a blocking copy
    (``cudaStreamSynchronize``: the host waits for all queued work); on CUDA the ids go through pinned memory and an
    asynchronous copy instead (the caching host allocator keeps the pinned block until the copy is done)."""
    host = torch.tensor(ids, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def raise_slot_error(where: str, problems: list[str]) -> None:
    if problems:
        raise SlotError(f"{where}: {'; '.join(problems)}")


def in_flight(pool: ReplaySSMStatePool) -> set[int]:
    """The slots of the open verify step (between its first verify and its commit; ``pool._spec_step``, which
    holds that verify's ``slots``), read back to the host; empty when no step is open (no sync then)."""
    step = getattr(pool, "_spec_step", None)
    if step is None:
        return set()
    return {int(i) for i in step.slots.tolist() if i >= 0}


def waiting(pool: ReplaySSMStatePool, ids: Iterable[int]) -> list[str]:
    """The problem of ``ids`` that lie in the open verify step: they wait for its commit (docs/spec.md); a host
    check of a call that syncs anyway (load_state, export/import, prefill) or of debug mode."""
    busy = sorted(set(ids) & in_flight(pool))
    return [f"slots between a verify and its commit (they wait for the commit; a commit with num_accepted 0 drops "
            f"a row's drafts): {busy}"] if busy else []


def refuse_bad_ids(pool: ReplaySSMStatePool, ids: list[int], where: str, *, unique: bool, writes: bool = True) -> None:
    """The host check of the slot ids of a call that syncs anyway (after its ``pool.check()``): each allocated,
    (``unique``) named once and (``writes``) not in the open verify step (:func:`waiting`); ``SlotError`` otherwise."""
    raise_slot_error(where, pool._slots.problems(ids, allow_padding=False, unique=unique)
                     + (waiting(pool, ids) if writes else []))


def debug_check(pool: ReplaySSMStatePool, slots: torch.Tensor, where: str, *, allow_padding: bool,
                unique: bool, in_step: bool = False) -> None:
    """Debug mode only (host sync): ``slots`` in range and allocated, optionally unique, their cursors in
    ``[0, L-1]``, and (unless the call is the open step's own verify or commit: ``in_step``) none of them in the open
    verify step (:func:`waiting`); ``SlotError`` naming the call otherwise."""
    ids = [int(i) for i in slots.tolist()]
    problems = pool._slots.problems(ids, allow_padding=allow_padding, unique=unique)
    if not in_step:
        problems += waiting(pool, ids)
    ok = [i for i in ids if pool._slots.is_allocated(i)]
    if ok:
        cur = pool.cursors[torch.tensor(ok, dtype=torch.long, device=pool.device)].tolist()
        off = {i: c for i, c in zip(ok, cur) if not 0 <= c <= pool.ring_length - 1}
        if off:
            problems.append(f"cursors outside [0, L-1 = {pool.ring_length - 1}]: {off}")
    raise_slot_error(f"{where} (debug check)", problems)
