"""The pool's cursor advance in one launch (:meth:`tp_replayssm.pool.ReplaySSMStatePool.advance`).

``advance`` runs once per model step, inside the caller's CUDA graph: a flushed row's cursor goes to 0, any other
to ``c + 1``. As a chain of small torch ops (:func:`advance_torch`, the reference and the CPU path) that cost 17-29 us
of graph time per step on the H200; this kernel takes ~1.2 us up to B = 512. It is ONE program (one CTA) over all
``B`` rows, because its phases are ordered by CTA barriers (``tl.debug_barrier()``, ``bar.sync``): gather every
row's cursor, barrier, store ``0 if flushed else c + 1``, barrier, store 0 for the flushed rows (a slot listed twice
ends at 0 if any of its rows flushed). Padding rows (slot < 0) use the scratch entry ``S``. One CTA holds at most
:data:`MAX_ROWS` rows; larger batches use the torch ops. ``B`` is a runtime argument, so batch sizes that share a
power of two share a compile (warm each bucket up before graph capture). On sm_90+ it is launched with programmatic
dependent launch and waits at entry, like the decode kernel.
"""

from __future__ import annotations

import functools
import logging

import torch

import helion
import helion.language as hl

from .guard import SlotGuard, record_bad_rows
from . import direct
from .backend import runs_kernel
from .args import no_flush
from .guard import spare_guard

__all__ = ["MAX_ROWS", "advance", "advance_kernel_for", "advance_launch", "advance_torch", "launch_choice"]

logger = logging.getLogger(__name__)

MAX_ROWS = 16384  # one CTA: 32 warps x 32 threads x 16 rows; decode batches are far smaller
_BARRIER = "tl.debug_barrier()"


def cursor_advance_kernel(
    cursors: torch.Tensor,  # [S + 1] int32, entry S is the scratch entry
    slots: torch.Tensor,  # [B] int32, < 0 = padding
    force_flush: torch.Tensor,  # [B] int32
    slot_errors: torch.Tensor,  # [ERROR_WORDS] int32, the pool's record of bad rows
    call_code: torch.Tensor,  # [1] int32, what this call records (kernels.guard.call_code)
    ring_length: int,
) -> torch.Tensor:
    """Advance ``cursors`` in place for the rows ``slots`` (module docstring); one program."""
    B = slots.size(0)
    scratch = cursors.size(0) - 1
    hl.pdl_wait()  # sm_90+: launched with PDL; nothing is read before the previous kernel has finished
    hl.pdl_launch_dependents()
    for tile_b in hl.tile(B):
        slot = slots[tile_b]
        in_range = (slot >= 0) & (slot < scratch)
        idx = torch.where(in_range, slot, scratch)  # padding and out-of-range rows read the scratch entry
        # count the rows that name each slot in the entry's upper bits (65536 = CURSOR_READER; padding adds 0)
        hl.atomic_add(cursors, [idx], torch.where(in_range, 65536, 0))
        hl.inline_triton(_BARRIER, args=(), output_like=None)  # every count before any read
        word = hl.load(cursors, [idx])
        c = word & 65535
        ok = in_range & (word < 131072) & (c < ring_length)  # named once, and allocated (a free slot's c is FREE)
        flushed = (c >= ring_length - 1) | (force_flush[tile_b] != 0)
        hl.inline_triton(_BARRIER, args=(), output_like=None)  # every read before any store
        # the moved cursor, or the cursor as it was (its count cleared) for a bad row or the scratch entry
        hl.store(cursors, [idx], torch.where(ok, torch.where(flushed, 0, c + 1), c))
        # record the bad rows only when there are any (no atomic on the every-step path)
        bad = torch.where((slot >= 0) & (ok == 0), 1, 0).to(torch.int32)
        n_bad = torch.sum(bad, dim=0).to(torch.int32)
        if n_bad > 0:
            record_rows(slot_errors, call_code[0], bad, n_bad, tile_b.index, slot)
    return cursors


def record_rows(slot_errors: torch.Tensor, code: torch.Tensor, bad: torch.Tensor, n_bad: torch.Tensor,
                rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Inside a one-program kernel whose batch is one tile (the cursor advance, the commit), called when the call has
    bad rows (``n_bad > 0``): record them in the pool's ``slot_errors`` as :func:`.guard.record_bad_rows` does with
    torch ops. The first call since the last check owns the record (kernels.guard.describe_record); one scalar atomic
    per record word, each bad row's place a prefix count over ``bad [B]`` (int32 0/1); ``code``: the call's
    (``call_code[0]``, read in the kernel's body); ``rows`` and ``slots`` [B]."""
    first = hl.atomic_cas(slot_errors, [0], n_bad * 0, code)  # int32 operands, as the pointer's
    hl.atomic_add(slot_errors, [2], n_bad)
    mine = (first == 0) | (first == code)
    base = hl.atomic_add(slot_errors, [1], torch.where(mine, n_bad, 0))
    at = base + hl.cumsum(bad, 0) - bad
    keep = torch.where(mine, (bad == 1) & (at < 8), False)  # RECORDED_ROWS (a where: docs/pitfalls.md)
    hl.store(slot_errors, [4 + 2 * at], rows, extra_mask=keep)
    hl.store(slot_errors, [5 + 2 * at], slots, extra_mask=keep)


_SETTINGS = dict(static_shapes=False, index_dtype=torch.int32)


def launch_choice(batch: int) -> tuple[int, int]:
    """``(block, num_warps)`` for ``batch`` rows (``1 <= batch <= MAX_ROWS``): block = next power of
    two >= batch (at least 32); 4 warps up to 1024 rows, then one more warp per 256 rows (<= 32)."""
    block = max(32, 1 << (batch - 1).bit_length())
    return block, min(32, max(4, block // 256))


@functools.lru_cache(maxsize=None)
def advance_kernel_for(block: int, num_warps: int) -> helion.Kernel:
    """The advance kernel pinned to one ``(block, num_warps)`` (one kernel object per pair)."""
    config = helion.Config(block_sizes=[block], indexing="pointer", num_warps=num_warps, num_stages=1)
    logger.debug("cursor advance kernel: block %d, %d warps", block, num_warps)
    return helion.kernel(cursor_advance_kernel, config=config, **_SETTINGS)


def advance_launch(cursors: torch.Tensor, slots: torch.Tensor, force_flush: torch.Tensor | None,
                   ring_length: int, guard: SlotGuard) -> None:
    """One kernel launch: ``cursors [S+1]``, ``slots [B]``, ``force_flush [B]`` int32 (or None) on one
    device, ``1 <= B <= MAX_ROWS``. No validation (the pool validates); the caller makes the device
    current. On CUDA, repeated calls of the same metadata launch the compiled kernel directly
    (:mod:`.direct`; the key holds the tensors' metadata and ``ring_length``, which with them
    determine every integer the launch passes: ``B``, the strides, the scratch index)."""
    B = slots.shape[0]
    if force_flush is None:
        force_flush = no_flush(B, slots.device)
    block, warps = launch_choice(B)
    kern = advance_kernel_for(block, warps)
    DIRECT_PLANS.launch(kern, kern.configs[0],
                        lambda: direct.LaunchArgs((cursors, slots, force_flush, *guard, ring_length),
                                                  (0, 1, 2, 3, 4, None), {}),
                        (cursors, slots, force_flush, *guard), cursors.device, (int(ring_length),))


DIRECT_PLANS = direct.PlanCache("cursor_advance")


def advance_torch(cursors: torch.Tensor, slots: torch.Tensor, force_flush: torch.Tensor | None,
                  ring_length: int, guard: SlotGuard | None = None) -> None:
    """The same update as torch ops (CPU pools, ``B > MAX_ROWS``), the reference for the kernel: a row whose slot is
    in range, named once and allocated moves its cursor; any other row changes nothing (a bad one is recorded in
    ``guard``). No host sync."""
    S = cursors.shape[0] - 1
    in_range = (slots >= 0) & (slots < S)
    idx = torch.where(in_range, slots, S).long()
    named = torch.zeros(S + 1, dtype=torch.int32, device=cursors.device).index_add_(0, idx, in_range.int())
    cur = cursors.index_select(0, idx)
    ok = in_range & (named.index_select(0, idx) == 1) & (cur >= 0) & (cur < ring_length)
    flushed = cur >= ring_length - 1
    if force_flush is not None:
        flushed = flushed | (force_flush != 0)
    # every row writes its own entry: a bad row and the scratch entry the value they hold, so repeats agree
    cursors.scatter_(0, idx, torch.where(ok, torch.where(flushed, torch.zeros_like(cur), cur + 1), cur))
    if guard is not None:
        record_bad_rows(guard.errors, guard.code, (slots >= 0) & ~ok, slots)


@functools.lru_cache(maxsize=None)
def _warn_fallback(batch: int) -> None:  # once per batch size
    logger.warning("cursor advance: %d rows > MAX_ROWS=%d, using the torch ops (several launches)", batch, MAX_ROWS)


def advance(cursors: torch.Tensor, slots: torch.Tensor, force_flush: torch.Tensor | None, ring_length: int,
            guard: SlotGuard | None = None) -> None:
    """The pool's dispatch: the kernel for ``1 <= B <= MAX_ROWS`` where kernels run (:mod:`.backend`), else the
    torch ops. ``guard``: where bad rows are recorded (the pool's); None records them nowhere."""
    B = slots.shape[0]
    guard = guard or spare_guard(cursors.device)
    if B and runs_kernel(cursors.device, "ReplaySSMStatePool.advance") and B <= MAX_ROWS:
        advance_launch(cursors, slots, force_flush, ring_length, guard)
    elif B:
        if cursors.device.type == "cuda":
            _warn_fallback(B)
        advance_torch(cursors, slots, force_flush, ring_length, guard)
