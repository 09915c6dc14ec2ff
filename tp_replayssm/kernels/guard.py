"""Slot safety on the device: how kernels (and their PyTorch forms) refuse bad slot ids and record them.

A row whose slot is out of range, not allocated, or repeated within one call is treated as a padding row on the
device (zero output, no byte of any slot changes) and recorded in the pool's error record; ``pool.check()`` reads the
record (a host sync) and raises ``SlotError``. "Allocated" lives in the cursor table: a free slot's cursor is
:data:`FREE_CURSOR`, which no ring position equals (rings are shorter than 65535 entries), so the kernels learn it
from the cursor read they do anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["ERROR_WORDS", "FREE_CURSOR", "RECORDED_ROWS", "SLOT_METHODS", "SlotGuard", "call_code",
           "describe_record", "record_bad_rows", "spare_guard"]

FREE_CURSOR = 0xFFFF
# the record: [0] the first bad call's code since the last check (0: none), [1] its bad rows, [2] bad rows of every
# call, [3] a scratch word (record_bad_rows' target for the rows it does not keep, zeroed after; the decode's store
# that never runs with pinned_loads), then (row, slot) pairs of the first RECORDED_ROWS bad rows of that call
RECORDED_ROWS = 8
ERROR_WORDS = 4 + 2 * RECORDED_ROWS
# the methods that take slots, by the number the kernels record
SLOT_METHODS = {1: "decode", 2: "advance", 3: "verify", 4: "commit", 5: "conv_update", 6: "fork"}
_METHOD_IDS = {name: i for i, name in SLOT_METHODS.items()}


def call_code(method: str, layer: int | None = None) -> int:
    """The number a call records: its method and layer (``layer + 1``; 0 for methods without one)."""
    return _METHOD_IDS[method] << 16 | (0 if layer is None else layer + 1)


def describe_record(record: list[int],
                    diagnose: Callable[[str, list[int]], str | None] | None = None) -> str | None:
    """The SlotError text of an error record read back to the host, or None when it holds no bad call.
    ``diagnose(method, slots shown)``: why those slots were refused, in brackets after them (the pool's
    ``SlotTable.diagnose``)."""
    code, n_rows, n_all = record[0], record[1], record[2]
    if code == 0:
        return None
    method, layer = SLOT_METHODS.get(code >> 16, f"method {code >> 16}"), (code & 0xFFFF) - 1
    pairs = [(record[4 + 2 * i], record[5 + 2 * i]) for i in range(min(n_rows, RECORDED_ROWS))]
    shown = ", ".join(f"row {r} slot {s}" for r, s in pairs) + (" ..." if n_rows > RECORDED_ROWS else "")
    why = diagnose(method, [s for _, s in pairs]) if diagnose is not None else None
    shown += f" [{why}]" if why else ""
    others = n_all - n_rows
    what = _WHAT.get(method, "named a slot that is out of range, not allocated, or repeated within the call")
    return (f"ReplaySSMStatePool.{method}{f'(layer={layer})' if layer >= 0 else ''}: {n_rows} row(s) {what} (the "
            f"first such call since the last check, with later calls of the same method and layer): {shown}; "
            f"{_DONE.get(method, 'they were treated as padding rows (zero output, nothing written)')}"
            + (f"; {others} more bad row(s) in later calls of other methods or layers" if others > 0 else ""))


# how a method's bad rows read (by default: out of range, not allocated, repeated) and what happened to them
_SPEC_ROWS = ("named a slot that is out of range, not allocated, or repeated within the call, or whose parents, "
              "num_accepted or path were not valid for the row")
_WHAT = {"verify": _SPEC_ROWS, "commit": _SPEC_ROWS,
         "fork": "(fork pairs) named a source or destination slot that is out of range or not allocated, or a "
                 "destination named again in the call (as a destination or a source), a source that is a "
                 "destination, or a slot of the open verify step (it waits for the commit); the slot shown is the "
                 "pair's source when the source is at fault, else its destination"}
_DONE = {"advance": "their cursors were left as they were",
         "commit": "they were left as they were (no cursor, ring or conv window changed)",
         "fork": "those pairs copied nothing"}


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


def spare_guard(device: torch.device) -> SlotGuard:
    """An error record nobody reads, for the op's launches (the kernel records only in the pool's calls)."""
    guard = _SPARE.get(device)
    if guard is None:
        guard = _SPARE[device] = SlotGuard(torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device),
                                           torch.zeros(1, dtype=torch.int32, device=device))
    return guard


_SPARE: dict[torch.device, SlotGuard] = {}
