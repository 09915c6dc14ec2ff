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

from . import direct
from .launch import no_flush

__all__ = ["MAX_ROWS", "advance", "advance_kernel_for", "advance_launch", "advance_torch", "launch_choice"]

logger = logging.getLogger(__name__)

MAX_ROWS = 16384  # one CTA: 32 warps x 32 threads x 16 rows; decode batches are far smaller
_BARRIER = "tl.debug_barrier()"


def cursor_advance_kernel(
    cursors: torch.Tensor,  # [S + 1] int32, entry S is the scratch entry
    slots: torch.Tensor,  # [B] int32, < 0 = padding
    force_flush: torch.Tensor,  # [B] int32
    ring_length: int,
) -> torch.Tensor:
    """Advance ``cursors`` in place for the rows ``slots`` (module docstring); one program."""
    B = slots.size(0)
    scratch = cursors.size(0) - 1
    hl.pdl_wait()  # sm_90+: launched with PDL; nothing is read before the previous kernel has finished
    hl.pdl_launch_dependents()
    for tile_b in hl.tile(B):
        slot = slots[tile_b]
        idx = torch.where(slot >= 0, slot, scratch)
        c = hl.load(cursors, [idx])
        flushed = (c >= ring_length - 1) | (force_flush[tile_b] != 0)
        hl.inline_triton(_BARRIER, args=(), output_like=None)  # every gather before any store
        hl.store(cursors, [idx], torch.where(flushed, 0, c + 1))
        hl.inline_triton(_BARRIER, args=(), output_like=None)  # every c+1 before the flush zeros
        hl.store(cursors, [idx], torch.zeros_like(c), extra_mask=flushed)
    return cursors


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
                   ring_length: int) -> None:
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
                        lambda: direct.LaunchArgs((cursors, slots, force_flush, ring_length), (0, 1, 2, None), {}),
                        (cursors, slots, force_flush), cursors.device, (int(ring_length),))


DIRECT_PLANS = direct.PlanCache("cursor_advance")


def advance_torch(cursors: torch.Tensor, slots: torch.Tensor, force_flush: torch.Tensor | None,
                  ring_length: int) -> None:
    """The same update as torch ops (CPU pools, ``B > MAX_ROWS``): the reference for the kernel."""
    idx = torch.where(slots >= 0, slots, cursors.shape[0] - 1).long()
    cur = cursors.index_select(0, idx)
    flushed = cur >= ring_length - 1
    if force_flush is not None:
        flushed = flushed | (force_flush != 0)
    new = torch.where(flushed, torch.zeros_like(cur), cur + 1)
    cursors.scatter_reduce_(0, idx, new, reduce="amin", include_self=False)


@functools.lru_cache(maxsize=None)
def _warn_fallback(batch: int) -> None:  # once per batch size
    logger.warning("cursor advance: %d rows > MAX_ROWS=%d, using the torch ops (several launches)", batch, MAX_ROWS)


def advance(cursors: torch.Tensor, slots: torch.Tensor, force_flush: torch.Tensor | None,
            ring_length: int) -> None:
    """The pool's dispatch: the kernel on CUDA for ``1 <= B <= MAX_ROWS``, else the torch ops."""
    B = slots.shape[0]
    if cursors.device.type == "cuda" and 0 < B <= MAX_ROWS:
        advance_launch(cursors, slots, force_flush, ring_length)
    elif B:
        if cursors.device.type == "cuda":
            _warn_fallback(B)
        advance_torch(cursors, slots, force_flush, ring_length)
