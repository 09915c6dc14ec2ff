"""The pool's slot bookkeeping: a host-side free list, and the checks of slot-id arguments.

:class:`SlotTable` hands out and takes back slot ids on the host, with no device sync (like vLLM's block pool). The
functions below check slot-id tensors by metadata (no sync) and, in debug mode, by value (a host sync).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from ..errors import PoolExhaustedError, SlotError
from ..validation import describe

__all__ = ["SlotTable", "check_ids", "is_int"]


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SlotTable:
    """Host-side free list of ``num_slots`` slot ids, handed out lowest first."""

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

    def take(self, n: int, where: str) -> list[int]:
        """``n`` free ids (``PoolExhaustedError``, taking none, when fewer are free)."""
        if not is_int(n) or n < 0:
            raise ValueError(f"{where}: `n` must be a non-negative int; got {n!r}")
        if n > len(self._free):
            raise PoolExhaustedError(f"{where}: asked for {n} slots but only {len(self._free)} of {self.num_slots} "
                                     "are free")
        ids = [self._free.popleft() for _ in range(n)]
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
            raise ValueError(f"{where}: nothing freed; {'; '.join(parts)}")
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


def raise_slot_error(where: str, problems: list[str]) -> None:
    if problems:
        raise SlotError(f"{where}: {'; '.join(problems)}")


# ---- slot safety on the device ---------------------------------------------------------------------------------
#
# A row whose slot is out of range, not allocated, or repeated within one call is treated as a padding row on the
# device (zero output, no byte of any slot changes) and recorded in the pool's error record; ``pool.check()`` reads
# the record (a host sync) and raises SlotError. "Allocated" lives in the cursor table: a free slot's cursor is
# FREE_CURSOR, which no ring position equals (rings are shorter than 65535 entries), so the kernels learn it from the
# cursor read they do anyway.

FREE_CURSOR = 0xFFFF
# the record: [0] the first bad call's code since the last check (0: none), [1] its bad rows, [2] bad rows of every
# call, [3] unused, then (row, slot) pairs of the first RECORDED_ROWS bad rows of that call
RECORDED_ROWS = 8
ERROR_WORDS = 4 + 2 * RECORDED_ROWS
# the methods that take slots, by the number the kernels record
SLOT_METHODS = {1: "decode", 2: "advance", 3: "verify", 4: "commit", 5: "conv_update", 6: "fork"}
_METHOD_IDS = {name: i for i, name in SLOT_METHODS.items()}


def call_code(method: str, layer: int | None = None) -> int:
    """The number a call records: its method and layer (``layer + 1``; 0 for methods without one)."""
    return _METHOD_IDS[method] << 16 | (0 if layer is None else layer + 1)


def describe_record(record: list[int]) -> str | None:
    """The SlotError text of an error record read back to the host, or None when it holds no bad call."""
    code, n_rows, n_all = record[0], record[1], record[2]
    if code == 0:
        return None
    method, layer = SLOT_METHODS.get(code >> 16, f"method {code >> 16}"), (code & 0xFFFF) - 1
    pairs = [(record[4 + 2 * i], record[5 + 2 * i]) for i in range(min(n_rows, RECORDED_ROWS))]
    shown = ", ".join(f"row {r} slot {s}" for r, s in pairs) + (" ..." if n_rows > RECORDED_ROWS else "")
    others = n_all - n_rows
    spec = (" (or, in speculative decoding, whose parents, num_accepted or path were not valid for the row)"
            if method in ("verify", "commit") else "")
    return (f"ReplaySSMStatePool.{method}{f'(layer={layer})' if layer >= 0 else ''}: {n_rows} row(s) named a slot "
            f"that is out of range, not allocated, or repeated within the call{spec} (the first such call since the "
            f"last check, with later calls of the same method and layer): {shown}; they were treated as padding rows "
            f"(zero output, nothing written)"
            + (f"; {others} more bad row(s) in later calls of other methods or layers" if others > 0 else ""))


class SlotGuard(NamedTuple):
    """What a call that takes slots hands its kernel for slot safety: the pool's error record ``errors
    [ERROR_WORDS]`` int32 and the call's code ``code [1]`` int32 (:func:`call_code`), both on the pool's device."""

    errors: torch.Tensor
    code: torch.Tensor


def record_bad_rows(errors: torch.Tensor, code: torch.Tensor, bad: torch.Tensor, slots: torch.Tensor) -> None:
    """Record ``bad [B]`` rows of a call (code ``[1]``) in ``errors`` with torch ops: the PyTorch path's form of what
    the kernels record, with no host sync."""
    code = code.reshape(()).to(errors.dtype)
    n_bad = bad.sum().to(errors.dtype)
    first = (errors[0] == 0) & (n_bad > 0)
    mine = first | (errors[0] == code)
    errors[0] = torch.where(first, code, errors[0])
    start = errors[1].clone()
    errors[2] += n_bad
    errors[1] += torch.where(mine, n_bad, torch.zeros_like(n_bad))
    # the bad rows first, in row order; each takes the next free pair while pairs remain
    order = torch.sort(bad.to(torch.int8), descending=True, stable=True).indices[:RECORDED_ROWS]
    pos = start + torch.arange(order.shape[0], device=errors.device, dtype=errors.dtype)
    keep = mine & bad[order] & (pos < RECORDED_ROWS)
    at = torch.where(keep, 4 + 2 * pos, torch.full_like(pos, 3)).long()  # word 3 takes the rows not kept
    errors.index_put_((at,), torch.where(keep, order.to(errors.dtype), errors[3]))
    errors.index_put_((torch.where(keep, at + 1, 3),), torch.where(keep, slots[order].to(errors.dtype), errors[3]))
    errors[3].zero_()  # (a Python value assigned would be a host-to-device copy, refused in graph capture)
